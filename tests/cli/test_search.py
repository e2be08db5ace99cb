"""``moend search`` and ``moend compare-solvers --measured-trials``: clear errors first, then the real thing."""

from __future__ import annotations

import json
import time

import pytest

from moend_fx.cli import main


def _no_model(monkeypatch):
    import moend_fx.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the storage was checked")

    monkeypatch.setattr(moend_fx.models, "load_model", refuse)


def test_a_corrupted_storage_fails_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    _no_model(monkeypatch)
    bad = tmp_path / "study.db"
    bad.write_bytes(b"not sqlite" * 100)
    t0 = time.perf_counter()
    assert main(["search", "--storage", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupted" in err and "Traceback" not in err
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("argv, msg", [
    (["search", "--check", "-1", "--storage", ":memory:"], "check"),
    (["search", "--trials", "0", "--storage", ":memory:"], "trials"),
    (["compare-solvers", "--table", "synthetic:4", "--budgets", "4x", "--trials", "", "--measured-trials", "3",
      "--out", "OUT"], "synthetic table"),
])
def test_user_errors_are_one_line(argv, msg, capsys, tmp_path, monkeypatch):
    _no_model(monkeypatch)
    argv = [str(tmp_path) if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def _real_table(smollm2, tmp_path):
    from moend_fx.calibration.pipeline import calibrate
    from moend_fx.calibration.tables import default_table_path

    path = default_table_path()
    if path.is_file():
        return path
    model, tok = smollm2
    return calibrate(model, tok, tokens=512).save(tmp_path / "t.safetensors")


@pytest.mark.slow
def test_search_and_compare_on_smollm2(smollm2, tmp_path, capsys):
    table = str(_real_table(smollm2, tmp_path))
    small = ["--tokens", "256", "--continuation", "8", "--sequences", "2", "--check", "1", "--no-progress"]
    storage = str(tmp_path / "s.journal")
    assert main(["search", "--table", table, "--budgets", "8x", "--trials", "4", "--storage", storage,
                 "--study", "cli", "--out", str(tmp_path / "search"), *small]) == 0
    out = capsys.readouterr().out
    assert "| 8x | greedy | 0 |" in out and "| 8x | searched |" in out
    doc = json.loads((tmp_path / "search" / "search.json").read_text())
    assert doc["budgets"][0]["trials"]["complete"] == 4
    # a second worker on the same study with a larger total runs only the missing trials
    assert main(["search", "--table", table, "--budgets", "8x", "--trials", "6", "--storage", storage,
                 "--study", "cli", "--out", str(tmp_path / "search"), *small]) == 0
    doc = json.loads((tmp_path / "search" / "search.json").read_text())
    assert doc["budgets"][0]["trials"]["complete"] == 6
    capsys.readouterr()
    assert main(["compare-solvers", "--table", table, "--budgets", "8x", "--trials", "", "--context-length", "256",
                 "--measured-trials", "3", "--storage", str(tmp_path / "c.journal"), "--out", str(tmp_path / "c"),
                 *small]) == 0
    out = capsys.readouterr().out
    assert "| 8x | exact |" in out and (tmp_path / "c" / "measured.png").is_file()
