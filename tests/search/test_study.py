"""The measured-search study: seeds first, a total shared by workers, resume, storages that cannot be used."""

from __future__ import annotations

import multiprocessing as mp
import socket
import sqlite3

import numpy as np
import optuna
import pytest

from moend_fx.common.errors import MoendError
from moend_fx.search import SearchSettings, open_study, run_worker
from moend_fx.search.study import check_storage, counted
from tests.search import helpers, search_worker


@pytest.fixture(scope="module")
def parts():
    m = helpers.model()
    t = helpers.table(m)
    return m, t, helpers.objective(m, t)


def _complete(study):
    return [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]


def test_greedy_is_trial_zero_exact_next_and_every_plan_fits(parts, tmp_path):
    _, t, obj = parts
    s = helpers.settings()
    problem = helpers.problem(t, s)
    study, _ = open_study(f"sqlite:///{tmp_path / 's.db'}", "one", problem, s)
    rep = run_worker(study, problem, obj, s)
    done = _complete(study)
    assert len(done) == s.trials and rep.measured + rep.reused == s.trials and rep.surplus == 0
    assert done[0].user_attrs["seed"] == "greedy" and done[0].user_attrs["indices"] == list(problem.seeds["greedy"])
    if problem.seeds["exact"] != problem.seeds["greedy"]:
        assert done[1].user_attrs["seed"] == "exact"
    assert all(tr.user_attrs["bytes"] <= problem.budget_bytes for tr in done)
    # the recorded KL is the measurement of the recorded plan
    tr = done[-1]
    assert tr.value == pytest.approx(obj(tr.user_attrs["indices"]), rel=0, abs=0)


@pytest.mark.parametrize("seen", ["params_seen", "params_unseen"])
def test_a_seeded_trial_handed_to_two_workers_is_told_once(parts, tmp_path, seen):
    """SQLite ignores the row lock optuna takes to pop an enqueued trial, so under load two workers can be handed
    the same seeded trial (seen in the two-process test below). The one that learns second goes on, whether it
    learns when it tells the result (it saw the plan's parameters) or when it suggests them (CI saw this: its
    view missed the other's parameters, so its suggest wrote to the finished trial)."""
    _, t, obj = parts
    s = helpers.settings(trials=4)
    problem = helpers.problem(t, s)
    study, _ = open_study(f"sqlite:///{tmp_path / 's.db'}", "dup", problem, s)
    first = study.ask()  # the greedy seed, as the other worker got it, measured and told first
    study.tell(first, obj(problem.space.propose(first)) if seen == "params_seen" else 1.0)
    ask, handed = study.ask, []

    def ask_twice():  # hand this worker the trial the other one has already told
        if not handed:
            handed.append(first.number)
            return optuna.Trial(study, first._trial_id)
        return ask()

    study.ask = ask_twice
    rep = run_worker(study, problem, obj, s)
    assert rep.duplicates == 1 and len(_complete(study)) == s.trials
    assert sorted(tr.number for tr in study.get_trials()) == list(range(len(study.get_trials())))


def test_resume_runs_to_the_new_total_and_keeps_earlier_trials(parts, tmp_path):
    _, t, obj = parts
    url = str(tmp_path / "s.journal")
    s5 = helpers.settings(trials=5)
    problem = helpers.problem(t, s5)
    study, _ = open_study(url, "r", problem, s5)
    run_worker(study, problem, obj, s5)
    first = [tr.user_attrs["indices"] for tr in _complete(study)]
    s9 = helpers.settings(trials=9)
    study, _ = open_study(url, "r", problem, s9)  # the total is not part of the problem: a study can grow
    run_worker(study, problem, obj, s9)
    done = _complete(study)
    assert len(done) == 9 and [tr.user_attrs["indices"] for tr in done[:5]] == first


def test_a_trial_left_running_by_a_dead_worker_is_failed_and_replaced(parts, tmp_path):
    _, t, obj = parts
    s = helpers.settings(trials=4)
    problem = helpers.problem(t, s)
    study, _ = open_study(f"sqlite:///{tmp_path / 's.db'}", "dead", problem, s)
    orphan = study.ask()
    dead = mp.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    orphan.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")
    run_worker(study, problem, obj, s)
    assert study.get_trials()[orphan.number].state == optuna.trial.TrialState.FAIL
    assert len(_complete(study)) == 4


def test_a_study_of_another_problem_is_refused(parts, tmp_path):
    _, t, _ = parts
    url = f"sqlite:///{tmp_path / 's.db'}"
    s = helpers.settings()
    open_study(url, "p", helpers.problem(t, s), s)
    other = helpers.settings(budget="3x")
    with pytest.raises(MoendError, match="another problem"):
        open_study(url, "p", helpers.problem(t, other), other)


def test_two_objectives_give_a_front(parts, tmp_path):
    _, t, obj = parts
    s = helpers.settings(objectives="kl_bytes", sampler="nsga2", trials=10)
    problem = helpers.problem(t, s)
    study, _ = open_study(":memory:", "mo", problem, s)
    run_worker(study, problem, obj, s)
    assert len(study.directions) == 2 and study.best_trials
    assert all(tr.values[1] == tr.user_attrs["bytes"] for tr in _complete(study))


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_processes_complete_the_total_with_no_lost_or_duplicated_trial(parts, tmp_path, kind):
    _, t, _ = parts
    table_path = t.save(tmp_path / "t.safetensors")
    storage = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else str(tmp_path / "s.journal")
    total = 16
    ctx = mp.get_context("spawn")
    ready, first = ctx.Barrier(2), ctx.Barrier(2)
    procs = [ctx.Process(target=search_worker.run, args=(storage, str(table_path), seed, total, ready, first))
             for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    study = optuna.load_study(study_name="shared", storage=check_storage_obj(storage))
    trials = study.get_trials()
    counted_trials = [tr for tr in trials if counted(tr)]
    assert len(counted_trials) == total  # the requested total, no more, no fewer
    assert all(tr.state == optuna.trial.TrialState.COMPLETE for tr in counted_trials)  # none lost
    numbers = [tr.number for tr in trials]
    assert len(set(numbers)) == len(numbers)  # none duplicated
    assert counted_trials[0].user_attrs["seed"] == "greedy"  # seeded once, before either worker asked
    assert sum(tr.user_attrs.get("seed") == "greedy" for tr in trials) == 1
    assert len({tr.user_attrs["worker"] for tr in counted_trials}) == 2


def check_storage_obj(storage: str):
    from moend_fx.solvers.optuna_storage import resolve_storage

    return resolve_storage(storage, None)[0]


@pytest.mark.parametrize("name, content", [("bad.db", b"this is not a database at all" * 10),
                                           ("bad.journal", b'{"op_code": 0, "worker_id": "x"\ngarbage\n')])
def test_a_corrupted_storage_is_a_one_line_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(MoendError) as e:
        check_storage(str(path), lock_timeout=1)
    assert "corrupted" in str(e.value) and "\n" not in str(e.value)
    assert path.read_bytes() == content  # nothing was written over it


def test_a_locked_storage_is_a_one_line_error(tmp_path):
    path = tmp_path / "s.db"
    url = f"sqlite:///{path}"
    check_storage(url)  # creates the schema
    con = sqlite3.connect(path, timeout=0)
    con.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(MoendError) as e:
            s = SearchSettings(lock_timeout=0.5)
            check_storage(url, lock_timeout=s.lock_timeout)
        assert "locked" in str(e.value) and "0.5 s" in str(e.value) and "\n" not in str(e.value)
    finally:
        con.rollback()
        con.close()


def test_settings_reject_bad_values():
    with pytest.raises(MoendError, match="objectives"):
        SearchSettings(objectives="loss")
    with pytest.raises(MoendError, match="sampler"):
        SearchSettings(sampler="cmaes")
    with pytest.raises(MoendError, match="trials"):
        SearchSettings(trials=0)
    assert np.isfinite(helpers.settings().trials)
