"""Evaluation report: summary rows and CIs, averages over tasks, infeasible rows, written files parse."""

from __future__ import annotations

import json

import pytest

from moend_fx.common.errors import MoendError
from moend_fx.eval.report import (
    AVG,
    headline,
    load_records,
    markdown_report,
    stratified_bootstrap,
    summarize_records,
    write_report,
)
from moend_fx.eval.stats import wilson_interval

FULL16 = 45_700_000


def _rec(task, method, budget, score, idx, measured=3_000_000, setting="query_aware", infeasible=None):
    r = dict(task=task, target_length=2048, index=idx, setting=setting, method=method, budget=budget,
             context_tokens=2040, full16_bytes=FULL16, full_model_bytes=2 * FULL16, budget_bytes=None,
             answers=["12345"], decode_s=0.5, new_tokens=6, predicted_loss=None)
    if infeasible:
        r.update(score=None, measured_bytes=None, infeasible=infeasible)
    else:
        r.update(score=score, measured_bytes=measured, ratio16=FULL16 / measured, ratio_model=2 * FULL16 / measured,
                 generated=" 12345.")
    return r


def _records():
    recs = []
    for i in range(10):
        recs.append(_rec("passkey", "full", None, 1.0, i, measured=2 * FULL16))
        recs.append(_rec("niah_single", "full", None, float(i < 7), i, measured=2 * FULL16))
        recs.append(_rec("passkey", "2d_hetero", "14x", float(i < 8), i, measured=3_200_000))
        recs.append(_rec("niah_single", "2d_hetero", "14x", float(i < 5), i, measured=3_300_000))
        recs.append(_rec("passkey", "1d", "14x", None, i, infeasible="budget 3264285 bytes is below the minimum"))
        recs.append(_rec("niah_single", "1d", "14x", None, i, infeasible="budget 3264285 bytes is below the minimum"))
    return recs


def test_summary_rows_counts_and_wilson_ci():
    rows = summarize_records(_records())
    row = next(r for r in rows if (r["task"], r["method"]) == ("passkey", "2d_hetero"))
    assert row["n"] == 10 and row["mean"] == pytest.approx(0.8)
    lo, hi = wilson_interval(8, 10)
    assert (row["low"], row["high"]) == pytest.approx((lo, hi)) and row["ci"] == "wilson"
    assert row["measured_bytes"] == pytest.approx(3_200_000)
    assert row["ratio16"] == pytest.approx(FULL16 / 3_200_000)
    avg = next(r for r in rows if (r["task"], r["method"]) == (AVG, "2d_hetero"))
    assert avg["mean"] == pytest.approx((0.8 + 0.5) / 2)  # mean of per-task means
    assert avg["n"] == 20 and avg["tasks"] == ["niah_single", "passkey"]
    inf = next(r for r in rows if (r["task"], r["method"]) == ("passkey", "1d"))
    assert inf["mean"] is None and inf["infeasible"] == 10 and "below the minimum" in inf["infeasible_reason"]


def test_stratified_bootstrap_weighs_tasks_equally():
    # Constant tasks: every replicate gives the same mean of task means, whatever the n per task.
    assert stratified_bootstrap([[1.0] * 30, [0.0] * 5]) == (0.5, 0.5, 0.5)
    mean, lo, hi = stratified_bootstrap([[1.0, 0.0] * 10, [1.0] * 4])
    assert mean == pytest.approx(0.75) and lo < mean < hi and 0.0 <= lo and hi <= 1.0


def test_markdown_has_one_table_per_setting_and_marks_infeasible():
    recs = _records() + [dict(r, setting="query_agnostic") for r in _records()]
    md = markdown_report(summarize_records(recs), {"config": {"tasks": ["passkey", "niah_single"], "n": 10},
                                                   "skipped_methods": {"hf_quant4": "needs optimum-quanto"}})
    assert md.count("### query_aware, 2048 tokens") == 1 and md.count("### query_agnostic, 2048 tokens") == 1
    assert "| 2d_hetero @ 14x | 50.0 [" in md and "| 80.0 [" in md
    assert "infeasible" in md and "Not run: `hf_quant4`" in md
    assert "16-bit" in md


def test_header_says_which_tasks_and_n_each_length_holds():
    """A run of several parts (or pooled runs) holds other tasks and n at another length: the header says so per
    length rather than repeating one part's configuration."""
    long = [dict(_rec("niah_single", m, b, 1.0, i), target_length=7900) for i in range(4)
            for m, b in (("full", None), ("2d_hetero", "14x"))]
    md = markdown_report(summarize_records(_records() + long), {"config": {"seed": 0}})
    assert ("2048 tokens: niah_single, passkey (n = 10 per task); 7900 tokens: niah_single (n = 4 per task); "
            "seed 0") in md
    assert "; seed 3; greedy" in markdown_report(summarize_records(long), {"config": {"seeds": [3]}})  # one pooled seed


def test_headline_compares_with_full_and_best_feasible_baseline():
    recs = _records() + [_rec(t, "2d_uniform", "14x", float(i < 3), i, measured=3_100_000)
                         for t in ("passkey", "niah_single") for i in range(10)]
    (h,) = headline(summarize_records(recs))
    assert h["budget"] == "14x" and h["mean"] == pytest.approx(0.65) and h["full"] == pytest.approx(0.85)
    assert h["vs_full"] == pytest.approx(-0.2)
    assert h["best_baseline"] == "2d_uniform" and h["vs_best"] == pytest.approx(0.35)
    assert h["infeasible_baselines"] == ["1d"]
    assert "| query_aware | 2048 | 14x | 65.0 |" in markdown_report(summarize_records(recs))


def _with_peak(r, peak):
    return dict(r, peak_bytes=peak, peak_ratio16=FULL16 / peak) if r.get("score") is not None else r


def test_peak_bytes_are_averaged_only_over_rows_whose_records_all_have_them():
    """Records written before the peak was measured lack it: a row mixing them shows no peak (its mean would
    cover other examples than its accuracy), a row whose records all have it shows it, per task and averaged."""
    recs = [_with_peak(r, r["measured_bytes"] + 100_000) if r["method"] == "2d_hetero" else r for r in _records()]
    recs += [_with_peak(_rec(t, "2d_uniform", "14x", 1.0, i, measured=3_100_000), 3_150_000)
             for t in ("passkey", "niah_single") for i in range(10)]
    recs[0] = _with_peak(recs[0], 2 * FULL16 + 10)  # one full-cache record of ten with a peak
    rows = summarize_records(recs)
    by = {(r["task"], r["method"]): r for r in rows}
    assert by[("passkey", "2d_hetero")]["peak_bytes"] == pytest.approx(3_300_000)
    assert by[(AVG, "2d_hetero")]["peak_bytes"] == pytest.approx(3_350_000)
    assert by[(AVG, "2d_hetero")]["peak_ratio16"] == pytest.approx((FULL16 / 3_300_000 + FULL16 / 3_400_000) / 2)
    assert by[("passkey", "full")]["peak_bytes"] is None and by[(AVG, "full")]["peak_bytes"] is None
    md = markdown_report(rows)
    assert "| 28.13 | 3.35 MB (13.6x) |" in md and "| 3.25 MB (14.1x) | 3.35 MB (13.6x) |" in md  # table, headline
    assert "| 3.10 MB | 3.15 MB (14.5x) |" in md  # the best baseline's measured and peak bytes
    full_row = next(line for line in md.splitlines() if line.startswith("| full |"))
    assert full_row.endswith("| - |")


def test_headline_tells_a_budget_no_baseline_ran_at_from_one_none_could_meet():
    """A budget only MoE-nD ran at says "none run", one where every baseline was infeasible "none feasible"."""
    infeasible_only = [r for r in _records() if r["method"] != "2d_uniform"]
    assert "| none feasible (1d infeasible) |" in markdown_report(summarize_records(infeasible_only))
    hetero_only = [r for r in _records() if r["method"] in ("full", "2d_hetero")]
    md = markdown_report(summarize_records(hetero_only))
    assert "| none run |" in md and "none feasible" not in md


def test_write_report_files_parse(tmp_path):
    paths = write_report(_records(), tmp_path, meta={"config": {"n": 10}}, plans={"x": {"layers": ["a"]}})
    doc = json.loads(paths["json"].read_text())
    assert doc["format"] == "moend_fx.eval" and len(doc["records"]) == 60 and doc["plans"]["x"]["layers"] == ["a"]
    assert any(r["task"] == AVG for r in doc["summary"])
    assert paths["md"].read_text().startswith("# Evaluation results")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_records(paths["json"]) == doc["records"]


def test_bad_input_raises(tmp_path):
    with pytest.raises(MoendError, match="no records"):
        write_report([], tmp_path)
    with pytest.raises(MoendError, match="lacks field"):
        summarize_records([{"task": "passkey"}])
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"format": "something"}))
    with pytest.raises(MoendError, match="not a moend_fx.eval results file"):
        load_records(bad)
