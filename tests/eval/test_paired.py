"""Paired accuracy against the full cache: counts, task weighting, seeds as distinct examples, unpaired runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.eval.paired import paired_accuracy
from moend_fx.eval.report import markdown_paired


def _rec(method, budget, idx, score, task="niah_single", seed=0, setting="query_aware"):
    return dict(task=task, target_length=2048, index=idx, seed=seed, setting=setting, method=method, budget=budget,
                score=score)


def _row(rows, method, budget="14x"):
    return next(r for r in rows if (r["method"], r["budget"]) == (method, budget))


def test_better_worse_and_the_difference_on_the_same_examples():
    full = [1, 1, 1, 0, 1, 0, 1, 1]
    ours = [1, 0, 1, 1, 0, 0, 1, 1]  # loses examples 1 and 4, wins 3
    recs = [_rec("full", None, i, s) for i, s in enumerate(full)] + [_rec("2d_hetero", "14x", i, s)
                                                                    for i, s in enumerate(ours)]
    row = _row(paired_accuracy(recs), "2d_hetero")
    assert (row["n"], row["better"], row["worse"], row["unpaired"]) == (8, 1, 2, 0)
    assert row["mean"] == pytest.approx(5 / 8) and row["reference_mean"] == pytest.approx(6 / 8)
    assert row["diff"] == pytest.approx(-1 / 8)
    assert row["low"] <= row["diff"] <= row["high"] and row["low"] < row["high"]
    assert not any(r["method"] == "full" for r in paired_accuracy(recs))


def test_the_same_answers_give_a_zero_difference_with_a_zero_width_interval():
    recs = [_rec(m, b, i, float(i % 3 == 0)) for m, b in (("full", None), ("lossless", None)) for i in range(9)]
    row = _row(paired_accuracy(recs), "lossless", None)
    assert (row["diff"], row["low"], row["high"], row["better"], row["worse"]) == (0.0, 0.0, 0.0, 0, 0)


def test_tasks_weigh_equally_whatever_their_n():
    recs = []
    for i in range(10):  # passkey: 10 examples, the method loses all of them
        recs += [_rec("full", None, i, 1.0, task="passkey"), _rec("pyramid", "14x", i, 0.0, task="passkey")]
    for i in range(2):  # niah_single: 2 examples, both right
        recs += [_rec("full", None, i, 1.0), _rec("pyramid", "14x", i, 1.0)]
    row = _row(paired_accuracy(recs), "pyramid")
    assert row["diff"] == pytest.approx(-0.5)  # (-1 + 0) / 2, not -10 / 12
    assert row["tasks"] == ["niah_single", "passkey"] and row["n"] == 12


def test_the_same_index_under_two_seeds_is_two_examples():
    recs = [_rec("full", None, 0, 1.0, seed=s) for s in (0, 1)]
    recs += [_rec("2d_hetero", "20x", 0, 1.0, seed=0), _rec("2d_hetero", "20x", 0, 0.0, seed=1)]
    row = _row(paired_accuracy(recs), "2d_hetero", "20x")
    assert (row["n"], row["worse"], row["seeds"]) == (2, 1, [0, 1])


def test_fractional_scores_infeasible_runs_and_examples_the_reference_lacks():
    recs = [_rec("full", None, i, 1.0, task="niah_multivalue") for i in range(3)]
    recs += [_rec("2d_hetero", "14x", 0, 0.5, task="niah_multivalue"),   # half the values: worse
             _rec("2d_hetero", "14x", 1, 1.0, task="niah_multivalue"),
             _rec("2d_hetero", "14x", 2, None, task="niah_multivalue"),  # infeasible: not paired
             _rec("2d_hetero", "14x", 7, 1.0, task="niah_multivalue")]   # no full record for #7
    row = _row(paired_accuracy(recs), "2d_hetero")
    assert (row["n"], row["unpaired"], row["worse"], row["better"]) == (2, 1, 1, 0)
    assert row["diff"] == pytest.approx(-0.25)
    assert "2 (1 unpaired)" in markdown_paired([row])


def test_no_reference_no_rows_and_settings_are_paired_apart():
    assert paired_accuracy([_rec("2d_hetero", "14x", 0, 1.0)]) == []
    recs = [_rec("full", None, 0, 1.0, setting="query_agnostic"), _rec("2d_hetero", "14x", 0, 0.0)]
    assert paired_accuracy(recs) == []  # the only full record is of the other setting


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=40))
def test_one_task_the_difference_is_wins_minus_losses_over_n(pairs):
    recs = [_rec("full", None, i, float(f)) for i, (f, _) in enumerate(pairs)]
    recs += [_rec("2d", "8x", i, float(o)) for i, (_, o) in enumerate(pairs)]
    row = _row(paired_accuracy(recs, n_boot=200), "2d", "8x")
    n = len(pairs)
    assert row["diff"] * n == pytest.approx(row["better"] - row["worse"])
    assert row["diff"] == pytest.approx(row["mean"] - row["reference_mean"])
    assert -1.0 <= row["low"] <= row["high"] <= 1.0


def test_a_budgeted_reference_is_paired_at_each_budget():
    recs = []
    for b, ref, other in (("14x", [1, 1, 0], [1, 0, 0]), ("20x", [0, 0, 0], [1, 1, 0])):
        recs += [_rec("2d_hetero", b, i, s) for i, s in enumerate(ref)]
        recs += [_rec("pyramid", b, i, s) for i, s in enumerate(other)]
    recs += [_rec("full", None, i, 1.0) for i in range(3)]
    rows = paired_accuracy(recs, "2d_hetero")
    assert {(r["method"], r["budget"]) for r in rows} == {("pyramid", "14x"), ("pyramid", "20x")}  # full: no budget
    assert (_row(rows, "pyramid")["worse"], _row(rows, "pyramid", "20x")["better"]) == (1, 2)
    assert "Paired with `2d_hetero`" in markdown_paired(rows)


def test_pairs_across_two_invocations_are_counted_and_shown():
    recs = [dict(_rec("full", None, i, 1.0), run="a") for i in range(4)]
    recs += [dict(_rec("2d_hetero", "14x", i, 1.0), run="a" if i < 3 else "b") for i in range(4)]
    recs += [_rec("pyramid", "14x", i, 1.0) for i in range(4)]  # made before records named their run
    rows = paired_accuracy(recs)
    hetero, pyramid = _row(rows, "2d_hetero"), _row(rows, "pyramid")
    assert (hetero["cross_run"], hetero["run_unknown"]) == (1, 0)
    assert (pyramid["cross_run"], pyramid["run_unknown"]) == (0, 4)
    md = markdown_paired(rows)
    assert "| 4 (1 across runs) |" in md and "pyramid @ 14x | 4 |" in md
