import json

import pytest

from moend_fx.common.errors import MoendError
from moend_fx.solvers import SOLVERS, get_solver
from moend_fx.solvers.compare import bench_solvers, compare_solvers, markdown_table, write_comparison
from tests.solvers.helpers import small_table

CTX = 512


def test_registry_and_unknown_names():
    assert set(SOLVERS) == {"greedy", "exact", "optuna", "1d", "2d_uniform", "2d", "pyramid"}
    with pytest.raises(MoendError, match="allowed: .*greedy.*exact"):
        get_solver("simplex")
    with pytest.raises(MoendError, match="bad option"):
        get_solver("greedy", n_trials=3)
    with pytest.raises(MoendError, match="no option"):
        get_solver("greedy").solve(small_table(3), "2x", context_length=CTX, n_trials=3)
    with pytest.raises(MoendError, match="context_length"):
        get_solver("greedy").solve(small_table(3), "2x", context_length=0)


def test_compare_writes_json_markdown_and_plot(tmp_path):
    t = small_table(5, seed=4)
    result = compare_solvers(t, ["2x", "4x", "1000x"], context_length=CTX, trials=(8,))
    rows = result["rows"]
    assert {r["solver"] for r in rows} == {"greedy", "exact", "2d", "2d_uniform", "1d", "pyramid", "optuna@8"}
    for r in rows:
        if r["budget"] == "1000x":
            assert r["error"] and "minimum feasible budget" in r["error"]
        elif r["error"] is None:
            assert r["bytes_used"] <= r["budget_bytes"]
            assert r["gap_pct"] >= -1e-6  # nobody beats the optimum (1e-6 %: float sums)
    assert all(r["gap_pct"] == 0 for r in rows if r["solver"] == "exact" and not r["error"])
    paths = write_comparison(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["rows"][0]["solver"] == "exact"
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 2x | greedy |" in markdown_table(result)


def test_bench_solvers_reports_figures():
    fig = bench_solvers(small_table(6), ["3x"], trials=(4,), context_length=CTX, repeats=3)
    b = fig["budgets"]["3x"]
    assert b["greedy_median_ms"] > 0 and b["exact_median_ms"] > 0 and b["greedy_gap_pct"] >= -1e-6
    assert "optuna@4_gap_pct" in b
