"""One Optuna study searching plans on measured KL, shared by any number of workers.

A worker (:func:`run_worker`) opens or creates the study in an Optuna storage (an RDB URL, SQLite by default;
a journal file for several processes on one machine; see :mod:`moend_fx.solvers.optuna_storage`). The
process that creates it enqueues the seed plans first, so greedy is trial 0 and exact (when it differs)
trial 1; workers that join wait until the seeds are in. Every worker then asks for trials until the study
holds ``trials`` counted ones (complete or running) and stops, so N workers started together run the
requested total between them. A trial numbered past the total (two workers asked at the same instant) is
told FAIL at once with ``user_attrs["surplus"]``, before anything is measured, and is not counted.
Restarting a worker resumes the study: a trial left RUNNING by a dead worker on this host is failed first.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.checks import check_choice, check_int
from moend_fx.common.errors import MoendError
from moend_fx.common.options import option_set
from moend_fx.plan.memory import parse_budget
from moend_fx.search.claims import Duplicate, fail_abandoned, told_elsewhere
from moend_fx.search.objective import HeldOutText, MeasuredKL
from moend_fx.search.space import Moves, Neighbourhood
from moend_fx.solvers import get_solver
from moend_fx.solvers.base import min_feasible_bytes, raise_infeasible
from moend_fx.solvers.optuna_storage import problem_key, resolve_storage, storage_error

Objectives = option_set(
    "Objectives", "What a measured search minimises: the KL alone under the budget, or KL and bytes (a front).",
    "kl", "kl_bytes", module=__name__)
SearchSampler = option_set(
    "SearchSampler", "Optuna samplers of a measured search (NSGA-II for the two-objective front).",
    "tpe", "nsga2", "random", module=__name__)
SearchSpace = option_set(
    "SearchSpace", "What a trial changes: two layers of a seed plan (an exchange), or every layer at once.",
    "moves", "layers", module=__name__)
SEED_PLANS: tuple[str, ...] = ("greedy", "exact")


@dataclass(frozen=True)
class SearchSettings:
    """A measured search: ``trials`` in the study in all (seed trials included), proposals within ``radius``
    places of the seed plans (``space``: :class:`Moves`, two layers per trial, or :class:`Neighbourhood`, every
    layer), at ``budget`` for the text's context."""

    budget: str = "14x"
    trials: int = 60
    radius: int = 2
    space: str = "moves"
    objectives: str = "kl"
    sampler: str = "tpe"
    seed: int = 0
    text: HeldOutText = field(default_factory=HeldOutText)
    lock_timeout: float = 120.0
    join_timeout: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "objectives", check_choice("objectives", self.objectives, Objectives))
        object.__setattr__(self, "sampler", check_choice("sampler", self.sampler, SearchSampler))
        object.__setattr__(self, "space", check_choice("space", self.space, SearchSpace))
        check_int("trials", self.trials)
        check_int("radius", self.radius, minimum=0)
        check_int("seed", self.seed, minimum=0)
        if not self.lock_timeout > 0 or not self.join_timeout > 0:
            raise MoendError(f"lock_timeout={self.lock_timeout!r} and join_timeout={self.join_timeout!r} must be "
                             "positive seconds")

    @property
    def multi(self) -> bool:
        return self.objectives == Objectives("kl_bytes")


@dataclass(frozen=True)
class Problem:
    """The arrays and seed plans one study searches: S, B [L, C]; seeds: name -> config indices [L]."""

    S: np.ndarray
    B: np.ndarray
    budget_bytes: int
    seeds: dict[str, tuple[int, ...]]
    space: Moves | Neighbourhood

    @classmethod
    def of(cls, table: SensitivityTable, settings: SearchSettings) -> Problem:
        ctx = settings.text.tokens
        parsed = parse_budget(settings.budget, table.fingerprint, ctx)
        S = np.asarray(table.loss, dtype=np.float64)
        B = np.asarray(table.bytes_matrix(ctx), dtype=np.int64)
        if parsed.bytes < min_feasible_bytes(B):
            raise_infeasible(parsed.bytes, min_feasible_bytes(B))
        seeds = {n: tuple(get_solver(n).solve(table, parsed.bytes, context_length=ctx).indices) for n in SEED_PLANS}
        if settings.space == SearchSpace("moves"):
            space: Moves | Neighbourhood = Moves.around(seeds, S, B, parsed.bytes, settings.radius)
        else:
            space = Neighbourhood.around(list(seeds.values()), S, B, parsed.bytes, settings.radius)
        return cls(S, B, parsed.bytes, seeds, space)

    def key(self, settings: SearchSettings) -> str:
        text = repr(sorted(settings.text.to_dict().items()))
        return problem_key(self.S, self.B, self.budget_bytes, f"measured|{self.space.key()}|{settings.objectives}"
                           f"|{text}")

    def predicted(self, idx: Any) -> float:
        return float(self.S[np.arange(self.S.shape[0]), np.asarray(idx, dtype=np.int64)].sum())


def check_storage(storage: Any, lock_timeout: float = 120.0) -> str:
    """Open the storage and list its studies (before a long model load): a one-line error if it is corrupted,
    locked or unreachable. Returns its description."""
    import optuna

    store, desc = resolve_storage(storage, None, lock_timeout)
    try:
        optuna.get_all_study_names(storage=store)
    except Exception as e:
        raise storage_error(desc, e, lock_timeout) from None
    return desc


def open_study(storage: Any, name: str | None, problem: Problem, settings: SearchSettings) -> tuple[Any, str]:
    """(the study, its storage description): created with the seed plans enqueued, or joined once they are."""
    import optuna

    store, desc = resolve_storage(storage, None, settings.lock_timeout)
    key = problem.key(settings)
    name = name or f"moend-search-{settings.budget}-{key}"
    sampler = optuna.samplers.NSGAIISampler(seed=settings.seed) if settings.sampler == "nsga2" else (
        optuna.samplers.RandomSampler(seed=settings.seed) if settings.sampler == "random"
        else optuna.samplers.TPESampler(seed=settings.seed, multivariate=True))
    directions = ["minimize", "minimize"] if settings.multi else ["minimize"]
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # progress is ours (tqdm), not a log line per trial
    try:
        try:
            study = optuna.create_study(storage=store, study_name=name, sampler=sampler, directions=directions)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study, created = optuna.load_study(storage=store, study_name=name, sampler=sampler), False
        if created:
            study.set_user_attr("problem", key)
            seen: set[tuple[int, ...]] = set()
            for seed_name, idx in problem.seeds.items():
                if idx not in seen:
                    seen.add(idx)
                    study.enqueue_trial(problem.space.seed_params(seed_name, idx), user_attrs={"seed": seed_name})
            study.set_user_attr("seeded", True)
        else:
            _wait_seeded(study, name, desc, key, settings.join_timeout)
    except MoendError:
        raise
    except Exception as e:  # corrupted file, locked database, journal with a torn line...
        raise storage_error(desc, e, settings.lock_timeout) from None
    return study, desc


def _wait_seeded(study: Any, name: str, desc: str, key: str, timeout: float) -> None:
    t0 = time.monotonic()
    while True:
        attrs = study.user_attrs
        known = attrs.get("problem")
        if known is not None and known != key:
            raise MoendError(f"study {name!r} in {desc} was made for another problem (table, budget, space or "
                             f"text differ: {known} != {key}); use a new --study name")
        if attrs.get("seeded"):
            return
        if time.monotonic() - t0 > timeout:
            raise MoendError(f"study {name!r} in {desc} was created but never seeded within {timeout:g} s (its "
                             "creator died?); use a new --study name")
        time.sleep(0.2)


def counted(trial: Any) -> bool:
    """Whether a trial counts toward the study's total (not failed, not a surplus slot)."""
    import optuna

    return trial.state != optuna.trial.TrialState.FAIL and not trial.user_attrs.get("surplus")


@dataclass
class WorkerReport:
    """What one worker did: trials measured here, surplus slots, trials reused from a same-plan trial, trials it
    measured that another worker had told first."""

    measured: int = 0
    reused: int = 0
    surplus: int = 0
    duplicates: int = 0  # trials another worker was handed too and told first (SQLite's enqueued-trial race)
    seconds: float = 0.0


def run_worker(study: Any, problem: Problem, objective: MeasuredKL, settings: SearchSettings, *,
               on_trial: Callable[[int, float], None] | None = None) -> WorkerReport:
    """Ask and measure trials until the study holds ``settings.trials`` counted trials.
    on_trial(counted trials so far, best KL so far) is called after each trial this worker finishes."""
    import optuna

    worker = f"{socket.gethostname()}:{os.getpid()}"
    rep, t_start = WorkerReport(), time.perf_counter()
    fail_abandoned(study)
    while sum(counted(t) for t in study.get_trials(deepcopy=False)) < settings.trials:
        trial = study.ask()
        before = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number and counted(t)]
        if len(before) >= settings.trials:
            trial.set_user_attr("surplus", True)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            rep.surplus += 1
            break
        t0 = time.perf_counter()
        try:
            with told_elsewhere(study, trial.number):
                idx = problem.space.propose(trial)
            reused = _same_plan(before, idx)
            try:
                per_seq = reused if reused is not None else objective.per_sequence(idx)
            except BaseException:  # interrupted or broken: the slot is freed for a resumed run
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            kl, used = float(np.mean(per_seq)), problem.space.bytes_of(idx)
            with told_elsewhere(study, trial.number):
                _record(trial, worker, idx, used, problem, per_seq, reused is not None, time.perf_counter() - t0)
                study.tell(trial, [kl, float(used)] if settings.multi else kl)
        except Duplicate:
            rep.duplicates += 1
            continue
        rep.reused += reused is not None
        rep.measured += reused is None
        if on_trial is not None:
            done = [t for t in study.get_trials(deepcopy=False) if counted(t) and "kl_per_sequence" in t.user_attrs]
            on_trial(len(done), min(float(np.mean(t.user_attrs["kl_per_sequence"])) for t in done))
    rep.seconds = time.perf_counter() - t_start
    return rep


def _record(trial: Any, worker: str, idx: np.ndarray, used: int, problem: Problem, per_seq: list[float],
            reused: bool, seconds: float) -> None:
    """What a measured trial keeps: who measured it, the plan, its bytes and KL, and the budget constraint."""
    trial.set_user_attr("worker", worker)
    trial.set_user_attr("indices", [int(i) for i in idx])
    trial.set_user_attr("bytes", used)
    trial.set_user_attr("predicted", problem.predicted(idx))
    trial.set_user_attr("kl_per_sequence", [float(x) for x in per_seq])
    trial.set_user_attr("reused", reused)
    trial.set_user_attr("seconds", seconds)
    trial.set_constraint("budget", (used - problem.budget_bytes) / problem.budget_bytes)


def _same_plan(trials: list[Any], idx: np.ndarray) -> list[float] | None:
    """The per-sequence KL of an earlier complete trial of the same plan (measuring it again would give the
    same numbers: the measurement is deterministic), else None."""
    want = [int(i) for i in idx]
    for t in trials:
        if t.user_attrs.get("indices") == want and "kl_per_sequence" in t.user_attrs:
            return list(t.user_attrs["kl_per_sequence"])
    return None
