"""A worker process for the shared-study test (its own module: spawned children import only this)."""

from moend_fx.solvers import get_solver
from tests.solvers.helpers import small_table

CTX = 512
BUDGET = "3x"


def table():
    return small_table(4, seed=7)


def run(url: str, seed: int, n_trials: int = 20) -> None:
    get_solver("optuna", n_trials=n_trials, storage=url, study_name="shared", seed=seed).solve(
        table(), BUDGET, context_length=CTX)
