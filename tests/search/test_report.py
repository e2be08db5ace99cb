"""The search report: front, paired gain and noise, greedy/exact/searched rows, files."""

from __future__ import annotations

import json
import math

import pytest

from moend_fx.search import open_study, report, run_worker
from moend_fx.search.objective import held_out_objectives
from tests.search import helpers


def test_pareto_front_keeps_only_non_dominated_points():
    pts = [(10, 5.0), (20, 3.0), (15, 6.0), (30, 3.0), (40, 1.0), (5, 9.0)]
    assert [pts[i] for i in report.pareto_front(pts)] == [(5, 9.0), (10, 5.0), (20, 3.0), (40, 1.0)]


def test_paired_gain_separates_signal_from_noise():
    base = [1.0, 1.2, 0.9, 1.1]
    noisy = [1.05, 1.1, 0.95, 1.05]  # differences of both signs: within noise
    assert report.paired_gain(base, noisy)["within_noise"]
    better = [0.5, 0.7, 0.4, 0.6]  # 0.5 lower on every sequence
    g = report.paired_gain(base, better)
    assert not g["within_noise"] and g["gain"] == pytest.approx(0.5) and g["gain_pct"] == pytest.approx(
        100 * 0.5 / 1.05)
    assert math.isnan(report.paired_gain([1.0], [0.5])["se"])


def test_summary_rows_check_set_and_files(tmp_path):
    m = helpers.model()
    t = helpers.table(m)
    search, held, source = held_out_objectives(m, None, t, helpers.TEXT, check=True)
    s = helpers.settings(trials=8)
    problem = helpers.problem(t, s)
    study, _ = open_study(":memory:", "rep", problem, s)
    run_worker(study, problem, search, s)
    summ = report.summarise(study, problem, t.grid.configs, held=held, budget=s.budget)
    rows = {r["plan"]: r for r in summ["rows"]}
    assert set(rows) == {"greedy", "exact", "searched"}
    assert rows["greedy"]["indices"] == list(problem.seeds["greedy"])
    assert rows["searched"]["kl_search"] <= rows["greedy"]["kl_search"]  # greedy is trial 0 of the search
    assert rows["searched"]["kl_check"] == pytest.approx(held(rows["searched"]["indices"]), rel=0, abs=0)
    assert summ["trials"]["complete"] == 8 and summ["front"]
    text = {**helpers.TEXT.to_dict(), "source": source}
    md = report.markdown([summ], text)
    assert "| 5x | greedy | 0 |" in md and "beat greedy" in md
    paths = report.write([summ], text, {s.budget: report.trial_points(study)}, tmp_path)
    assert json.loads(paths["json"].read_text())["budgets"][0]["rows"][0]["plan"] == "greedy"
    assert paths["png"].stat().st_size > 0


def _summary(greedy, searched, check_g, check_s, same=False):
    rows = [{"plan": "greedy", "indices": [0, 0], "kl_search": sum(greedy) / len(greedy)},
            {"plan": "exact", "indices": [0, 0], "kl_search": 0.0},
            {"plan": "searched", "indices": [0, 0] if same else [1, 0], "kl_search": sum(searched) / len(searched)}]
    return {"rows": rows, "trials": {"complete": 50}, "gain_search": report.paired_gain(greedy, searched),
            "gain_check": report.paired_gain(check_g, check_s), "best_other": {"trial": 7, "kl_search": 0.31}}


def test_the_verdict_says_what_was_found_in_plain_words():
    g = [0.30, 0.32, 0.28, 0.31]
    assert report._verdict(_summary(g, g, g, g, same=True)).startswith("no plan of the 50 measured beat greedy")
    lower = [x - 0.05 for x in g]
    noisy = [0.31, 0.30, 0.30, 0.29]
    v = report._verdict(_summary(g, lower, g, noisy))
    assert "but not beyond noise on the held-out" in v and "greedy is end-to-end optimal within noise" in v
    assert "better than greedy beyond noise on the held-out" in report._verdict(_summary(g, lower, g, lower))
