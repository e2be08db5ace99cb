import pytest

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.cli import main
from moend_fx.plan.memory import PARTS, keep_count, keep_floor, plan_bytes, plan_parts
from moend_fx.plan.routing import RoutingPlan
from moend_fx.solvers.synthetic import synthetic_table
from tests.cli.helpers import parse_rows, with_stats


def test_solve_synthetic_writes_plan_and_prints_table(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["solve", "--table", "synthetic:6:1", "--budget", "8x", "--solver", "exact",
                 "--context-length", "1024", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = RoutingPlan.load(out)
    assert plan.solver == "exact" and plan.num_layers == 6 and plan.context_length == 1024
    assert plan.bytes_planned <= plan.budget_bytes
    assert "pred. loss" in text and "smaller than 16-bit" in text and "float32" in text


def test_solve_loads_table_files(tmp_path, capsys):
    table = synthetic_table(4, seed=2)
    path = table.save(tmp_path / "t.safetensors")
    out = tmp_path / "plan.json"
    assert main(["solve", "--table", str(path), "--budget", "4x", "--solver", "2d", "--out", str(out)]) == 0
    assert "solver: 2d" in capsys.readouterr().out
    plan = RoutingPlan.load(out)
    assert plan.predicted_loss == pytest.approx(SensitivityTable.load(path).predicted_loss(plan), rel=1e-12)


def test_missing_table_file_is_a_clear_error(tmp_path, capsys):
    assert main(["solve", "--table", str(tmp_path / "nope.safetensors"), "--budget", "4x"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["solve", "--table", "synthetic:x", "--budget", "4x"], "synthetic:LAYERS"),
    (["solve", "--table", "synthetic:4", "--budget", "0.5x"], "must be >= 1x"),
    (["solve", "--table", "synthetic:4", "--budget", "1000x", "--solver", "exact"], "minimum feasible budget"),
    (["solve", "--table", "synthetic:4", "--budget", "4x", "--context-length", "-3"], "context-length"),
    (["compare-solvers", "--table", "synthetic:4", "--budgets", "4x", "--trials", "a", "--out", "x"], "--trials"),
])
def test_cli_user_errors_are_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_compare_solvers_cli(tmp_path, capsys):
    assert main(["compare-solvers", "--table", "synthetic:4", "--budgets", "3x,6x", "--trials", "5",
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "compare.md").exists() and (tmp_path / "compare.png").exists()
    assert "optuna@5" in capsys.readouterr().out



@pytest.mark.parametrize("stats", [False, True])
def test_solve_prints_bytes_by_part_and_totals_equal_plan_bytes(tmp_path, capsys, stats):
    table = synthetic_table(6, seed=1)
    table = with_stats(table) if stats else table
    path = table.save(tmp_path / "t.safetensors")
    out = tmp_path / "plan.json"
    assert main(["solve", "--table", str(path), "--budget", "8x", "--solver", "exact",
                 "--context-length", "1024", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = RoutingPlan.load(out)
    header = next(line for line in text.splitlines() if line.startswith("layer"))
    assert header.split() == ["layer", "config", "kept", "K", "codes", "V", "codes", "scales", "residual",
                              "positions", "scorer", "total", "pred.", "loss"]
    rows = parse_rows(text, r"\d+")
    assert [r[1] for r in rows] == [c.name for c in plan.layers]
    expect = plan_parts(plan, calibrated=stats)
    for r, c, parts in zip(rows, plan.layers, expect):
        assert int(r[2]) == keep_count(1024, c.keep_ratio, keep_floor(plan))
        cells = [int(x) for x in r[3:10]]
        assert cells[:6] == [parts[k] for k in PARTS] and sum(cells[:6]) == cells[6]
    (totals,) = parse_rows(text, "total")
    total_cells = [int(x) for x in totals[1:8]]
    assert total_cells[:6] == [sum(int(r[3 + i]) for r in rows) for i in range(6)]
    # what the solver budgeted and the plan file records; with calibrated statistics, plan_bytes' default
    assert total_cells[6] == plan.bytes_planned == plan_bytes(plan, calibrated=stats) <= plan.budget_bytes
    if stats:
        assert total_cells[6] == plan_bytes(plan)
    (share,) = parse_rows(text, "share")
    pct = [float(x.rstrip("%")) for x in share[1:]]
    assert pct == pytest.approx([100 * v / total_cells[6] for v in total_cells], abs=0.051)
    assert f"trig {'with' if stats else 'without'} calibrated query statistics" in text


def test_narrow_k_min_keep_sets_the_last_resort_rule(tmp_path, capsys):
    def solve(*extra, budget="14x"):
        out = tmp_path / "plan.json"
        assert main(["solve", "--table", "synthetic:30:0", "--budget", budget, "--context-length", "2048",
                     "--out", str(out), *extra]) == 0
        return RoutingPlan.load(out), capsys.readouterr().out

    narrow_low = lambda plan: sum(c.k_bits <= 4 and c.keep_ratio < 0.5 for c in plan.layers)  # noqa: E731
    default, text = solve()
    assert narrow_low(default) == 0 and "last resort" not in text
    off, _ = solve("--narrow-k-min-keep", "0")
    assert narrow_low(off) > 0
    # 16x: between the least bytes without a last-resort layer (14.4x here) and with them (17.3x); the text says so
    tight, text = solve(budget="16x")
    assert narrow_low(tight) > 0 and f"last resort: {narrow_low(tight)} layer(s)" in text


def test_narrow_k_max_context_bounds_the_rule_by_context_length(tmp_path):
    def solve(ctx, *extra):
        out = tmp_path / "plan.json"
        assert main(["solve", "--table", "synthetic:30:0", "--budget", "16x", "--context-length", str(ctx),
                     "--out", str(out), *extra]) == 0
        return RoutingPlan.load(out)

    narrow_low = lambda plan: sum(c.k_bits <= 4 and c.keep_ratio < 0.5 for c in plan.layers)  # noqa: E731
    assert narrow_low(solve(4096)) == 0  # the default covers 4k
    assert narrow_low(solve(4097)) > 0  # and nothing longer
    assert narrow_low(solve(4097, "--narrow-k-max-context", "0")) == 0  # 0: every length
    assert narrow_low(solve(4096, "--narrow-k-max-context", "2048")) > 0


def test_a_bad_narrow_k_min_keep_is_a_clear_error(capsys):
    assert main(["solve", "--table", "synthetic:4", "--budget", "4x", "--narrow-k-min-keep", "2"]) == 2
    assert "allowed: a number in [0, 1]" in capsys.readouterr().err


def test_a_bad_narrow_k_max_context_is_a_clear_error(capsys):
    assert main(["solve", "--table", "synthetic:4", "--budget", "4x", "--narrow-k-max-context", "-1"]) == 2
    assert "allowed: an int >= 0" in capsys.readouterr().err
