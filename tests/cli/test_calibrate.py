"""``moend show-table``'s bytes by part (the rest of show-table: tests/calibration/test_sensitivity.py)."""

import json

import pytest

from moend_fx.cli import main
from moend_fx.plan.config import LayerConfig
from moend_fx.plan.memory import PARTS, full_cache_bytes, keep_count, plan_layer_parts
from moend_fx.solvers.synthetic import synthetic_table
from tests.cli.helpers import parse_rows, with_stats


@pytest.mark.parametrize("stats", [False, True])
def test_show_table_prints_each_configs_bytes_by_part(tmp_path, capsys, stats):
    table = synthetic_table(3, seed=4, context_length=512)
    table = with_stats(table) if stats else table
    path = table.save(tmp_path / "t.safetensors")
    assert main(["show-table", str(path), "--json"]) == 0
    text = capsys.readouterr().out
    assert "bytes of one layer by part at 512 tokens" in text
    header = next(line for line in text.splitlines() if line.startswith("config "))
    assert header.split() == ["config", "kept", "K", "codes", "V", "codes", "scales", "residual", "positions",
                              "scorer", "total", "vs", "16-bit"]
    rows = parse_rows(text, r"keep[0-9.]+_k\d+_v\d+")
    configs = table.grid.configs
    assert [r[0] for r in rows] == [c.name for c in configs]
    B = table.bytes_matrix(512)
    for i, (r, c) in enumerate(zip(rows, configs)):
        cells = [int(x) for x in r[2:9]]
        parts = plan_layer_parts(c, 512, table.fingerprint, group_size=table.group_size, scorer="trig",
                                 calibrated=stats)
        assert cells[:6] == [parts[k] for k in PARTS]
        assert cells[6] == sum(cells[:6]) == B[0, i] == B[-1, i]  # what the solver prices, on every layer
        assert int(r[1]) == keep_count(512, c.keep_ratio, 36)
        full16 = full_cache_bytes(table.fingerprint, 512) / table.num_layers
        assert float(r[9].rstrip("x")) == pytest.approx(full16 / cells[6], abs=0.006)
        if not c.evicts:
            assert parts["scorer_state"] == parts["positions"] == 0
    body = json.loads(text[text.index("\n{") + 1:])
    assert body["bytes_by_part"]["context_length"] == 512
    assert body["bytes_by_part"]["configs"]["keep0.1_k4_v4"] == plan_layer_parts(
        LayerConfig(0.1, 4, 4), 512, table.fingerprint, scorer="trig", calibrated=stats)


def test_calibrate_measures_gains_by_default_and_not_with_no_gains(tmp_path, capsys):
    """`moend calibrate` makes a calibration-v3 table (per-layer gains) unless --no-gains asks for the paper's."""
    from moend_fx.calibration.sensitivity import SensitivityTable
    from tests.models.helpers import save_tiny_folder

    folder = tmp_path / "tiny"
    folder.mkdir()
    save_tiny_folder(folder, "llama-gqa3-hd64")
    for extra, gained in (([], True), (["--no-gains"], False)):
        out = tmp_path / f"t{len(extra)}.safetensors"
        argv = ["calibrate", "--model", str(folder), "--tokens", "128", "--sequences", "1", "--quiet",
                "--out", str(out), *extra]
        assert main(argv) == 0
        assert str(out) in capsys.readouterr().out
        table = SensitivityTable.load(out)
        assert (table.gain is not None) is gained
        assert table.calibration["gain_probe"] == ("keep0.5_k4_v4" if gained else None)
        if gained:
            assert (table.gain > 0).all() and table.gain.shape == (table.num_layers,)


def test_calibrate_measure_top1_is_recorded_in_the_table(tmp_path, capsys):
    from moend_fx.calibration.sensitivity import SensitivityTable
    from tests.models.helpers import save_tiny_folder

    folder = tmp_path / "tiny"
    folder.mkdir()
    save_tiny_folder(folder, "llama-gqa3-hd64")
    out = tmp_path / "top1.safetensors"
    assert main(["calibrate", "--model", str(folder), "--tokens", "128", "--sequences", "1", "--quiet",
                 "--no-gains", "--measure", "top1", "--out", str(out)]) == 0
    table = SensitivityTable.load(out)
    assert table.calibration["measure"] == "top1"
    assert ((table.S >= 0) & (table.S <= 1)).all()  # shares of rows


@pytest.mark.parametrize("extra, named", [(["--retrieval-tails", "5"], "retrieval_tails=5"),
                                          (["--gain-probe", "keep1.0_k16_v16"], "gain_probe")])
def test_calibrate_rejects_bad_settings_before_loading_the_model(monkeypatch, capsys, tmp_path, extra, named):
    """A bad option fails at once with the allowed values: no model is loaded for a run that cannot start."""
    import moend_fx.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(moend_fx.models, "load_model", no_load)
    argv = ["calibrate", "--sequences", "2", "--quiet", "--out", str(tmp_path / "t.safetensors"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moend: error:") and named in err
    assert not (tmp_path / "t.safetensors").exists()
