import pytest

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.cli import main
from moend_fx.plan.routing import RoutingPlan
from moend_fx.solvers.synthetic import synthetic_table


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
