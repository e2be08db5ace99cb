"""A worker process for the shared-study tests (its own module: spawned children import only this)."""

from __future__ import annotations

import torch


def run(storage: str, table_path: str, seed: int, trials: int, ready=None, first=None) -> None:
    """One worker of a shared study. ``ready``: a barrier the workers meet at once set up (model built, study
    open), so a worker that started late still finds trials left. ``first``: a barrier they meet once each has
    told its first trial: under load one worker could otherwise measure the whole total before the other is
    scheduled (CI saw it), and the test is about two workers sharing one study."""
    from moend_fx.calibration.sensitivity import SensitivityTable
    from moend_fx.search import open_study, run_worker
    from tests.search import helpers

    torch.set_num_threads(1)
    m = helpers.model()
    t = SensitivityTable.load(table_path)
    s = helpers.settings(trials=trials, seed=seed)
    problem = helpers.problem(t, s)
    study, _ = open_study(storage, "shared", problem, s)
    if ready is not None:
        ready.wait(timeout=240)
    told = []

    def meet_after_the_first(done: int, best: float) -> None:
        if first is not None and not told:
            told.append(done)
            first.wait(timeout=240)

    run_worker(study, problem, helpers.objective(m, t), s, on_trial=meet_after_the_first)
