"""moend_fx.bench.compile_time: cold and warm compiles of the decode graph in fresh processes, on a tiny model
folder. Structure and cache counters, never timings."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from moend_fx.bench import compile_time as C
from moend_fx.bench.decode import DecodeBenchSettings
from moend_fx.cli import main
from moend_fx.common.errors import MoendError
from tests.models.helpers import save_tiny_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_compile")
    save_tiny_folder(path, "llama-gqa3-hd64")
    return path


@pytest.mark.parametrize("methods", [(), ("full_eager",), ("moend_compiled", "nope")])
def test_bad_methods(methods):
    with pytest.raises(MoendError, match="allowed: one or more of full_inductor, moend_compiled"):
        C.bench_compile_times("x", DecodeBenchSettings(), length=96, methods=methods)


def test_child_in_this_process(folder, tmp_path):
    """What one fresh process does, run here (the backend's passes with the eager inner compiler: seconds)."""
    spec = {"model": str(folder), "method": "moend_compiled", "phase": "cold", "length": 96, "steps": 2,
            "threads": 1, "settings": DecodeBenchSettings(inner="eager").to_dict(), "table": None, "plan": None,
            "result": str(tmp_path / "row.json")}
    threads = torch.get_num_threads()
    try:
        row = C.run_child(spec)
    finally:
        torch.set_num_threads(threads)
    assert row["tokens"] == 96 and len(row["step_s"]) == 3 and row["graphs"] >= 1
    assert row["steady_step_s"] == statistics.median(row["step_s"][1:])
    assert row["compile_s"] == pytest.approx(sum(max(0.0, t - row["steady_step_s"]) for t in row["step_s"]))
    assert row["first_step_s"] == row["step_s"][0] and row["threads"] == 1
    # what the backend's own passes took, per pass (this process's total: the compile above ran them)
    assert {"find_attention", "validate_plan", "fuse_quantized_attention"} <= set(row["passes_s"])
    assert all(v > 0 for v in row["passes_s"].values())


def test_a_failing_child_is_a_row(tmp_path):
    res = C.bench_compile_times(str(tmp_path / "no-such-model"), DecodeBenchSettings(inner="eager"), length=96,
                                methods=("moend_compiled",), threads=1)
    assert [(r["method"], r["phase"]) for r in res["rows"]] == [("moend_compiled", "cold"),
                                                                  ("moend_compiled", "warm")]
    assert all("no-such-model" in r["error"] for r in res["rows"])


def test_cli_compile_times_are_reported(folder, tmp_path, capsys, monkeypatch):
    calls = {}

    def fake(model_name, settings, **kw):
        calls.update(kw, model=model_name)
        rows = [{"method": "moend_compiled", "phase": p, "tokens": 48, "compile_s": s, "first_step_s": s + 0.1,
                 "steady_step_s": 0.01, "graphs": 1, "inductor_counters": {"fxgraph_cache_hit": h}}
                for p, s, h in (("cold", 60.0, 0), ("warm", 9.0, 3))]
        return {"tokens": 48, "threads": 1, "steps": 4, "rows": rows}

    monkeypatch.setattr(C, "bench_compile_times", fake)
    out = tmp_path / "res"
    code = main(["bench", "decode", "--model", str(folder), "--lengths", "64,48", "--steps", "1", "--warmup", "0",
                 "--methods", "full_eager,moend_eager,moend_compiled", "--inner", "eager", "--compile-times",
                 "--threads", "1", "--out", str(out), "--doc", "", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    assert calls["methods"] == ("moend_compiled",) and calls["length"] == 48 and calls["model"] == str(folder)
    assert "| moend_compiled | warm | 9.0 s | 0.00 s |" in printed  # no passes_s in the fake rows: 0
    result = json.loads((out / "decode" / "decode.json").read_text())
    assert result["compile_times"]["rows"][0]["phase"] == "cold"
    assert "Compile time of the decode graph" in (out / "decode" / "decode.md").read_text()
    assert "--compile-times" in (out / "sections" / "decode.json").read_text()
