import multiprocessing as mp

import numpy as np
import optuna
import pytest

from moend_fx.common.errors import BudgetError, MoendError
from moend_fx.solvers import get_solver
from moend_fx.solvers.optuna_search import OptunaSolver, repair_by_bytes, resolve_storage
from tests.solvers import optuna_worker

CTX = optuna_worker.CTX
BUDGET = optuna_worker.BUDGET


def _table():
    return optuna_worker.table()


def test_optuna_plan_is_feasible_and_reports_trials():
    t = _table()
    res = get_solver("optuna", n_trials=15, storage=":memory:").solve(t, BUDGET, context_length=CTX)
    assert res.bytes_used <= res.budget.bytes
    assert res.info["trials"] == 15 and res.info["optimal"] is False and res.iterations == 15
    assert res.plan.solver == "optuna"
    exact = get_solver("exact").solve(t, BUDGET, context_length=CTX)
    assert res.predicted_loss >= exact.predicted_loss - 1e-9  # 1e-9: same floats, maybe other order


@pytest.mark.parametrize("sampler", ["tpe", "nsga2", "random"])
def test_samplers_without_repair_return_only_feasible_plans(sampler):
    t = _table()
    try:
        res = get_solver("optuna", n_trials=20, sampler=sampler, repair="none", storage=":memory:",
                         warm_start=True).solve(t, BUDGET, context_length=CTX)
    except MoendError as e:  # allowed outcome: no feasible trial, said clearly
        assert "found no plan within the budget" in str(e)
        return
    assert res.bytes_used <= res.budget.bytes


def test_warm_start_is_at_least_as_good_as_greedy():
    t = _table()
    greedy = get_solver("greedy").solve(t, BUDGET, context_length=CTX)
    res = get_solver("optuna", n_trials=5, warm_start=True, storage=":memory:").solve(t, BUDGET, context_length=CTX)
    assert res.predicted_loss <= greedy.predicted_loss + 1e-12


def test_repair_by_bytes_fits():
    rng = np.random.default_rng(0)
    B = rng.integers(1, 50, size=(5, 7))
    S = rng.random((5, 7))
    ranks = np.stack([np.lexsort((np.arange(7), S[l], B[l])) for l in range(5)])
    pos_of = np.argsort(ranks, axis=1)
    budget = int(B.min(1).sum()) + 10
    idx = repair_by_bytes(B.argmax(1), ranks, pos_of, B, budget)
    assert B[np.arange(5), idx].sum() <= budget


def test_default_storage_is_sqlite_and_journal_paths_work(tmp_path):
    t = _table()
    res = get_solver("optuna", n_trials=3).solve(t, BUDGET, context_length=CTX)
    assert res.info["storage"].startswith("sqlite:///")
    journal = tmp_path / "study.log"
    res = get_solver("optuna", n_trials=3, storage=str(journal)).solve(t, BUDGET, context_length=CTX)
    assert journal.exists() and res.info["storage"].startswith("journal:")


def test_shared_study_rejects_another_problem(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    t = _table()
    get_solver("optuna", n_trials=2, storage=url, study_name="x").solve(t, "3x", context_length=CTX)
    with pytest.raises(MoendError, match="another problem"):
        get_solver("optuna", n_trials=2, storage=url, study_name="x").solve(t, "4x", context_length=CTX)


def test_bad_options_raise():
    with pytest.raises(MoendError, match="allowed"):
        OptunaSolver(sampler="bogus")
    with pytest.raises(MoendError, match="n_trials"):
        OptunaSolver(n_trials=0)
    with pytest.raises(MoendError, match="storage"):
        resolve_storage(3.5, None)
    with pytest.raises(BudgetError, match="minimum feasible budget"):
        get_solver("optuna", n_trials=2, storage=":memory:").solve(_table(), "1000x", context_length=CTX)


def test_cmaes_without_package_is_a_clear_error():
    pytest.importorskip("optuna")
    try:
        import cmaes  # noqa: F401
    except ImportError:
        with pytest.raises(MoendError, match="pip install cmaes"):
            get_solver("optuna", sampler="cmaes", n_trials=2, storage=":memory:").solve(
                _table(), BUDGET, context_length=CTX)
    else:
        res = get_solver("optuna", sampler="cmaes", n_trials=5, storage=":memory:").solve(
            _table(), BUDGET, context_length=CTX)
        assert res.bytes_used <= res.budget.bytes


def test_two_processes_share_one_sqlite_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=optuna_worker.run, args=(url, seed)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    study = optuna.load_study(study_name="shared", storage=url)
    done = [tr for tr in study.trials if tr.state == optuna.trial.TrialState.COMPLETE]
    workers = {tr.user_attrs["worker"] for tr in done}
    assert len(done) == 40 and len(workers) == 2
    # Each worker ran its 20 trials in the one study.
    assert sorted(sum(tr.user_attrs["worker"] == w for tr in done) for w in workers) == [20, 20]
    # A third call on the same study sees all trials and returns the best feasible one.
    res = get_solver("optuna", n_trials=1, storage=url, study_name="shared").solve(_table(), BUDGET,
                                                                                 context_length=CTX)
    assert res.info["trials"] == 41 and res.info["workers"] == 3  # the two workers + this process
    assert res.bytes_used <= res.budget.bytes
