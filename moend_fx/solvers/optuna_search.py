"""Optuna as an independent black-box check: a study over per-layer config indices.

Each trial picks one config per layer (parameters ``l00``, ``l01``...: categorical config indices for TPE,
NSGA-II and random search; integer ranks by bytes for CMA-ES, which needs an ordinal space). The objective
is the predicted loss; a plan over budget gets a penalised value (worse than any feasible plan, growing with
the excess) so every sampler learns to avoid it, and constraint-aware samplers (TPE, NSGA-II) also get
``trial.set_constraint("budget", excess / budget)`` (<= 0 is feasible; Optuna 5 deprecated
``constraints_func`` for it). By default a proposal over budget is first *repaired* by bytes alone (see
:func:`repair_by_bytes`), since 30 categorical dimensions rarely land within a tight budget by chance (0
feasible trials in 300 at 14x on a 30-layer table). The result is the best *feasible* trial of the study.

Storage (:mod:`moend_fx.solvers.optuna_storage`) defaults to an SQLite file in a fresh temp folder (deleted
afterwards). Any Optuna storage works: an RDB URL (``sqlite:///x.db``, ``postgresql://...``), a journal file
path, or ``":memory:"``. With a given storage and study name (``load_if_exists``) several processes or
machines search one study; each trial records its worker (``host:pid``) in ``user_attrs["worker"]``.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from moend_fx.common.checks import check_choice, check_int
from moend_fx.common.errors import MoendError
from moend_fx.common.options import option_set
from moend_fx.plan.grid import Grid
from moend_fx.solvers.base import (
    ArraySolution,
    Solver,
    min_feasible_bytes,
    plan_bytes_of,
    plan_loss,
    raise_infeasible,
)
from moend_fx.solvers.greedy import greedy_indices
from moend_fx.solvers.optuna_storage import problem_key, resolve_storage

Sampler = option_set(
    "Sampler", "Optuna samplers the solver can run (CMA-ES needs the ``cmaes`` package and an ordinal space).",
    "tpe", "cmaes", "nsga2", "random", module=__name__)
Space = option_set(
    "Space", "What a trial parameter is: a categorical config index, or the config's rank by bytes.",
    "config", "ordinal", module=__name__)
Repair = option_set(
    "Repair", "What happens to a proposal over budget: stepped down by bytes, or scored with a penalty.",
    "bytes", "none", module=__name__)

SAMPLERS: tuple[str, ...] = tuple(str(s) for s in Sampler)
SPACES: tuple[str, ...] = tuple(str(s) for s in Space)
REPAIRS: tuple[str, ...] = tuple(str(s) for s in Repair)


def make_sampler(name: str, seed: int | None) -> Any:
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
    sampler: Sampler = Sampler.TPE
    seed: int | None = 0
    storage: Any = None
    study_name: str | None = None
    n_jobs: int = 1
    timeout: float | None = None
    show_progress_bar: bool = False
    warm_start: bool = False
    space: Space = Space.CONFIG
    repair: Repair = Repair.BYTES

    def __post_init__(self) -> None:
        # Held as the enum members, so a plain string and a member give equal solvers.
        object.__setattr__(self, "sampler", check_choice("optuna sampler", self.sampler, Sampler, error=MoendError))
        object.__setattr__(self, "space", check_choice("optuna space", self.space, Space, error=MoendError))
        object.__setattr__(self, "repair", check_choice("optuna repair", self.repair, Repair, error=MoendError))
        for name in ("n_trials", "n_jobs"):
            check_int(name, getattr(self, name))

    def solve_arrays(self, S: np.ndarray, B: np.ndarray, budget: int, grid: Grid | None = None) -> ArraySolution:
        """S: [L, C] float64; B: [L, C] int64. The best feasible trial of the study (see the module docstring)."""
        import optuna

        minimum = min_feasible_bytes(B)
        if budget < minimum:
            raise_infeasible(budget, minimum)
        space = _Space.of(self, S, B)
        key = problem_key(S, B, budget, space.label)
        tmpdir = tempfile.mkdtemp(prefix="moend-optuna-") if self.storage is None else None
        old_verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            storage, desc = resolve_storage(self.storage, tmpdir)
            study = self._open_study(storage, desc, key)
            if self.warm_start and not study.trials:
                g, _ = greedy_indices(S, B, budget)
                study.enqueue_trial(space.params(g))
            before = len(study.trials)
            study.optimize(_objective(space, S, B, budget, self.repair), n_trials=self.n_trials,
                           n_jobs=self.n_jobs, timeout=self.timeout, show_progress_bar=self.show_progress_bar,
                           gc_after_trial=False)
            return self._best(study, before, space.label, desc)
        finally:
            optuna.logging.set_verbosity(old_verbosity)
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)

    def _open_study(self, storage: Any, desc: str, key: str) -> Any:
        """The study (created or joined), refusing one that was made for another problem."""
        import optuna

        study = optuna.create_study(storage=storage, sampler=make_sampler(self.sampler, self.seed),
                                    study_name=self.study_name or f"moend-{key}", direction="minimize",
                                    load_if_exists=True)
        known = study.user_attrs.get("problem")
        if known is None:
            study.set_user_attr("problem", key)
        elif known != key:
            raise MoendError(f"optuna study {study.study_name!r} in {desc} was made for another problem "
                             f"(table, budget or search space differ: {known} != {key}); use a new study name")
        return study

    def _best(self, study: Any, before: int, label: str, desc: str) -> ArraySolution:
        """The best feasible complete trial (ties: fewer bytes, then the earlier trial) and the study's stats."""
        import optuna

        trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        feasible = [t for t in trials if t.user_attrs.get("excess", 1.0) <= 0]
        if not feasible:
            raise MoendError(f"optuna ({self.sampler}, repair={str(self.repair)!r}) found no plan within the "
                             f"budget in {len(trials)} trials; raise n_trials, use repair='bytes' or "
                             "warm_start=True")
        best = min(feasible, key=lambda t: (t.user_attrs["loss"], t.user_attrs["bytes"], t.number))
        idx = tuple(int(i) for i in best.user_attrs["indices"])
        workers = sorted({t.user_attrs.get("worker", "?") for t in trials})
        return ArraySolution(idx, len(study.trials) - before, {
            "optimal": False, "sampler": str(self.sampler), "space": label, "trials": len(trials),
            "feasible_trials": len(feasible), "best_trial": best.number, "study_name": study.study_name,
            "storage": desc, "workers": len(workers),
        })


@dataclass(frozen=True)
class _Space:
    """How a trial's parameters map to config indices. ranks: [L, C] configs of each layer sorted by (bytes, S,
    index), the order the ordinal space and the repair walk; pos_of: [L, C] its inverse."""

    ordinal: bool
    repair: str
    ranks: np.ndarray
    pos_of: np.ndarray
    names: tuple[str, ...]

    @classmethod
    def of(cls, solver: OptunaSolver, S: np.ndarray, B: np.ndarray) -> _Space:
        L, C = S.shape
        ranks = np.stack([np.lexsort((np.arange(C), S[l], B[l])) for l in range(L)])
        return cls(solver.space == Space.ORDINAL or solver.sampler == Sampler.CMAES, str(solver.repair), ranks,
                   np.argsort(ranks, axis=1), tuple(f"l{l:02d}" for l in range(L)))

    @property
    def label(self) -> str:
        """Part of the problem key: a study searched in one space must not be fed trials of another."""
        return ("ordinal" if self.ordinal else "config") + f"|repair={self.repair}"

    def indices(self, trial: Any) -> np.ndarray:
        """[L] config indices a trial proposes."""
        C = self.ranks.shape[1]
        if self.ordinal:
            return np.array([self.ranks[l, trial.suggest_int(n, 0, C - 1)] for l, n in enumerate(self.names)])
        return np.array([trial.suggest_categorical(n, list(range(C))) for n in self.names])

    def params(self, idx: np.ndarray) -> dict[str, int]:
        """The trial parameters that propose config indices ``idx`` [L] (to enqueue a known plan)."""
        return {n: int(self.pos_of[l, idx[l]]) if self.ordinal else int(idx[l]) for l, n in enumerate(self.names)}


def _objective(space: _Space, S: np.ndarray, B: np.ndarray, budget: int, repair: str) -> Any:
    """The study's objective: a trial's predicted loss, or a penalty (> any feasible plan's loss, growing with
    the excess) when its plan is over budget. Each trial records its plan and figures in ``user_attrs``."""
    penalty = float(S.max(axis=1).sum()) + 1.0
    worker = f"{socket.gethostname()}:{os.getpid()}"

    def objective(trial: Any) -> float:
        idx = space.indices(trial)
        if repair == Repair.BYTES:
            idx = repair_by_bytes(idx, space.ranks, space.pos_of, B, budget)
        loss, used = plan_loss(S, idx), plan_bytes_of(B, idx)
        excess = (used - budget) / budget
        trial.set_user_attr("worker", worker)
        trial.set_user_attr("loss", loss)
        trial.set_user_attr("bytes", used)
        trial.set_user_attr("excess", excess)
        trial.set_user_attr("indices", [int(i) for i in idx])
        trial.set_constraint("budget", excess)
        return loss if excess <= 0 else penalty + excess

    return objective
