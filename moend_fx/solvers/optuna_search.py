"""Optuna as an independent black-box check: a study over per-layer config indices.

Each trial picks one config per layer (parameters ``l00``, ``l01``...: categorical config indices for TPE,
NSGA-II and random search; integer ranks by bytes for CMA-ES, which needs an ordinal space). The objective
is the predicted loss; a plan over budget gets a penalised value (worse than any feasible plan, growing with
the excess) so every sampler learns to avoid it, and constraint-aware samplers (TPE, NSGA-II) also get
``trial.set_constraint("budget", excess / budget)`` (<= 0 is feasible; Optuna 5 deprecated
``constraints_func`` for it). By default a proposal over budget is first *repaired* by bytes alone (see
:func:`repair_by_bytes`), since 30 categorical dimensions rarely land within a tight budget by chance (0
feasible trials in 300 at 14x on a 30-layer table). The result is the best *feasible* trial of the study.

Storage defaults to an SQLite file in a fresh temp folder (deleted afterwards). Any Optuna storage works:
an RDB URL (``sqlite:///x.db``, ``postgresql://...``), a journal file path, or ``":memory:"``. With a given
storage and study name (``load_if_exists``) several processes or machines search one study; each trial
records its worker (``host:pid``) in ``user_attrs["worker"]``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import Grid
from moend_fx.solvers.base import (
    ArraySolution,
    Solver,
    min_feasible_bytes,
    plan_bytes_of,
    plan_loss,
    raise_infeasible,
)
from moend_fx.solvers.greedy import greedy_indices

SAMPLERS: tuple[str, ...] = ("tpe", "cmaes", "nsga2", "random")
SPACES: tuple[str, ...] = ("config", "ordinal")
REPAIRS: tuple[str, ...] = ("bytes", "none")
_RDB_SUFFIXES = (".db", ".sqlite", ".sqlite3")
_OPEN_ATTEMPTS = 5


def problem_key(S: np.ndarray, B: np.ndarray, budget: int, space: str) -> str:
    """A short hash naming the problem, so a shared study is never fed trials of another problem."""
    h = hashlib.sha256()
    for a in (np.ascontiguousarray(S, dtype=np.float64), np.ascontiguousarray(B, dtype=np.int64)):
        h.update(a.tobytes())
        h.update(str(a.shape).encode())
    h.update(f"{budget}|{space}".encode())
    return h.hexdigest()[:16]


def resolve_storage(storage: Any, tmpdir: str | None) -> tuple[Any, str]:
    """(what ``optuna.create_study`` takes, a description). See the module docstring for accepted forms."""
    import optuna

    if storage is None:
        assert tmpdir is not None
        storage = f"sqlite:///{Path(tmpdir) / 'optuna.db'}"
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage, type(storage).__name__
    if not isinstance(storage, (str, os.PathLike)):
        raise MoendError(f"optuna storage {storage!r} is not a storage URL or path; allowed: an RDB URL "
                         "('sqlite:///study.db', 'postgresql://...'), a journal file path, or ':memory:'")
    s = str(storage)
    if s in (":memory:", "memory"):
        return optuna.storages.InMemoryStorage(), "in-memory"
    if "://" in s:
        kw: dict[str, Any] = {}
        if s.startswith("sqlite"):
            # Several processes write one SQLite file: wait for the lock instead of failing at once.
            kw["engine_kwargs"] = {"connect_args": {"timeout": 120}}
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return optuna.storages.RDBStorage(s, **kw), _redact(s)
            except Exception as e:  # bad dialect, unreachable server, missing driver, schema race...
                # Workers that start together race to create the schema; the loser sees an integrity error
                # and succeeds on retry once the winner is done.
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise MoendError(f"optuna storage {_redact(s)!r} cannot be opened: {e}") from None
                time.sleep(0.2 * (attempt + 1))
    path = Path(s)
    if path.suffix in _RDB_SUFFIXES:
        return resolve_storage(f"sqlite:///{path.resolve()}", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend = optuna.storages.journal.JournalFileBackend(str(path))
    return optuna.storages.JournalStorage(backend), f"journal:{path}"


def _redact(url: str) -> str:
    """Hide a password in ``scheme://user:password@host``."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def _make_sampler(name: str, seed: int | None) -> Any:
    """Constraint-aware samplers read ``trial.set_constraint`` values (Optuna >= 5 replaced ``constraints_func``
    with it); the others see only the penalised objective."""
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        try:
            import cmaes  # noqa: F401  (optuna's CmaEsSampler needs it)
        except ImportError:
            raise MoendError("sampler 'cmaes' needs the 'cmaes' package (pip install cmaes); "
                             f"other samplers: {[s for s in SAMPLERS if s != 'cmaes']}") from None
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    raise MoendError(f"optuna sampler {name!r} is unknown; allowed: {list(SAMPLERS)}")


def repair_by_bytes(idx: np.ndarray, ranks: np.ndarray, pos_of: np.ndarray, B: np.ndarray, budget: int
                    ) -> np.ndarray:
    """Make a plan fit without looking at S: step the layer with the most bytes above its cheapest config
    one config down (by bytes) until the plan fits. idx: [L]; ranks: [L, C] configs sorted by bytes;
    pos_of: [L, C] inverse of ranks; B: [L, C]. Terminates: all-cheapest fits (checked before)."""
    L = B.shape[0]
    rows = np.arange(L)
    pos = pos_of[rows, idx].copy()
    cur = B[rows, ranks[rows, pos]]
    floor = B[rows, ranks[:, 0]]
    used = int(cur.sum())
    while used > budget:
        l = int(np.argmax(cur - floor))
        pos[l] -= 1
        new = B[l, ranks[l, pos[l]]]
        used += int(new - cur[l])
        cur[l] = new
    return ranks[rows, pos]


@dataclass(frozen=True)
class OptunaSolver(Solver):
    """Black-box search with Optuna. No optimality guarantee; the gap to ``exact`` shrinks with trials.

    ``space``: "config" (one categorical config index per layer) or "ordinal" (integer rank of the config by
    bytes; always used by CMA-ES). ``repair``: "bytes" (a proposal over budget is stepped down by bytes alone,
    never looking at S, before it is scored: every trial is feasible) or "none" (scored with a penalty).
    """

    name = "optuna"
    n_trials: int = 200
    sampler: str = "tpe"
    seed: int | None = 0
    storage: Any = None
    study_name: str | None = None
    n_jobs: int = 1
    timeout: float | None = None
    show_progress_bar: bool = False
    warm_start: bool = False
    space: str = "config"
    repair: str = "bytes"

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise MoendError(f"optuna sampler {self.sampler!r} is unknown; allowed: {list(SAMPLERS)}")
        if self.space not in SPACES:
            raise MoendError(f"optuna space {self.space!r} is unknown; allowed: {list(SPACES)}")
        if self.repair not in REPAIRS:
            raise MoendError(f"optuna repair {self.repair!r} is unknown; allowed: {list(REPAIRS)}")
        for name in ("n_trials", "n_jobs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoendError(f"{name}={v!r} is invalid; allowed: a positive integer")

    def solve_arrays(self, S: np.ndarray, B: np.ndarray, budget: int, grid: Grid | None = None) -> ArraySolution:
        import optuna

        L, C = S.shape
        minimum = min_feasible_bytes(B)
        if budget < minimum:
            raise_infeasible(budget, minimum)
        ordinal = self.space == "ordinal" or self.sampler == "cmaes"
        # Configs of each layer sorted by (bytes, S, index): the ordinal space and the repair walk this order.
        ranks = np.stack([np.lexsort((np.arange(C), S[l], B[l])) for l in range(L)])
        pos_of = np.argsort(ranks, axis=1)
        space = ("ordinal" if ordinal else "config") + f"|repair={self.repair}"
        key = problem_key(S, B, budget, space)
        penalty = float(S.max(axis=1).sum()) + 1.0  # > any feasible plan's loss
        worker = f"{socket.gethostname()}:{os.getpid()}"
        names = [f"l{l:02d}" for l in range(L)]
        choices = list(range(C))

        def objective(trial: Any) -> float:
            if ordinal:
                idx = np.array([ranks[l, trial.suggest_int(names[l], 0, C - 1)] for l in range(L)])
            else:
                idx = np.array([trial.suggest_categorical(names[l], choices) for l in range(L)])
            if self.repair == "bytes":
                idx = repair_by_bytes(idx, ranks, pos_of, B, budget)
            loss, used = plan_loss(S, idx), plan_bytes_of(B, idx)
            excess = (used - budget) / budget
            trial.set_user_attr("worker", worker)
            trial.set_user_attr("loss", loss)
            trial.set_user_attr("bytes", used)
            trial.set_user_attr("excess", excess)
            trial.set_user_attr("indices", [int(i) for i in idx])
            trial.set_constraint("budget", excess)
            return loss if excess <= 0 else penalty + excess

        tmpdir = tempfile.mkdtemp(prefix="moend-optuna-") if self.storage is None else None
        old_verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            storage, desc = resolve_storage(self.storage, tmpdir)
            study = optuna.create_study(
                storage=storage,
                sampler=_make_sampler(self.sampler, self.seed),
                study_name=self.study_name or f"moend-{key}",
                direction="minimize",
                load_if_exists=True,
            )
            known = study.user_attrs.get("problem")
            if known is None:
                study.set_user_attr("problem", key)
            elif known != key:
                raise MoendError(f"optuna study {study.study_name!r} in {desc} was made for another problem "
                                 f"(table, budget or search space differ: {known} != {key}); use a new study name")
            if self.warm_start and not study.trials:
                g, _ = greedy_indices(S, B, budget)
                study.enqueue_trial({names[l]: int(pos_of[l, g[l]]) if ordinal else int(g[l]) for l in range(L)})
            before = len(study.trials)
            study.optimize(objective, n_trials=self.n_trials, n_jobs=self.n_jobs, timeout=self.timeout,
                           show_progress_bar=self.show_progress_bar, gc_after_trial=False)
            trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
            feasible = [t for t in trials if t.user_attrs.get("excess", 1.0) <= 0]
            if not feasible:
                raise MoendError(f"optuna ({self.sampler}, repair={self.repair!r}) found no plan within the "
                                 f"budget in {len(trials)} trials; raise n_trials, use repair='bytes' or "
                                 "warm_start=True")
            best = min(feasible, key=lambda t: (t.user_attrs["loss"], t.user_attrs["bytes"], t.number))
            idx = tuple(int(i) for i in best.user_attrs["indices"])
            workers = sorted({t.user_attrs.get("worker", "?") for t in trials})
            return ArraySolution(idx, len(study.trials) - before, {
                "optimal": False, "sampler": self.sampler, "space": space, "trials": len(trials),
                "feasible_trials": len(feasible), "best_trial": best.number, "study_name": study.study_name,
                "storage": desc, "workers": len(workers),
            })
        finally:
            optuna.logging.set_verbosity(old_verbosity)
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
