"""A worker process for the shared-study tests (its own module: spawned children import only this)."""

from __future__ import annotations

import torch


def run(storage: str, table_path: str, seed: int, trials: int) -> None:
    from moend_fx.calibration.sensitivity import SensitivityTable
    from moend_fx.search import open_study, run_worker
    from tests.search import helpers

    torch.set_num_threads(1)
    m = helpers.model()
    t = SensitivityTable.load(table_path)
    s = helpers.settings(trials=trials, seed=seed)
    problem = helpers.problem(t, s)
    study, _ = open_study(storage, "shared", problem, s)
    run_worker(study, problem, helpers.objective(m, t), s)
