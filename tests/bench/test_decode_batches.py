"""The decode benchmark at batch sizes > 1, its memory cap and its new options (library and CLI). Structure and
arithmetic, never timings."""

from __future__ import annotations

import json
import statistics

import pytest

from moend_fx.bench import decode as D
from moend_fx.bench.capacity import BASIS
from moend_fx.cli import main
from moend_fx.common.errors import MoendError
from moend_fx.models import tiny_preset
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.plan.routing import ModelFingerprint
from tests.models.helpers import save_tiny_folder

SMALL = dict(lengths=(64, 96), steps=2, warmup=1, methods=("full_eager", "moend_eager"))


@pytest.fixture(scope="module")
def model():
    return tiny_preset("llama-gqa3-hd64")


@pytest.fixture(scope="module")
def result(model):
    settings = D.DecodeBenchSettings(batches=(1, 3), batch_lengths=(96,), memory_cap="50MB", **SMALL)
    return D.bench_decode(model, settings, progress=False)


def test_batches_run_at_their_lengths_only(result):
    got = [(r["method"], r["tokens"], r["batch"]) for r in result["rows"]]
    assert got == [(m, n, b) for m in ("full_eager", "moend_eager") for n, b in ((64, 1), (96, 1), (96, 3))]
    assert all(r["status"] == "ok" for r in result["rows"])


def test_tokens_per_s_is_batch_over_step_time(result, model):
    fp = ModelFingerprint.from_model(model)
    rows = {(r["method"], r["tokens"], r["batch"]): r for r in result["rows"]}
    for (method, n, b), r in rows.items():
        assert r["tokens_per_s"] == pytest.approx(b / (r["ms_median"] / 1e3))
        assert r["seq_length_after"] == n
        base = rows[("full_eager", n, b)]  # speed-up against the baseline at the same length and batch
        assert r["speedup_vs_baseline"] == pytest.approx(base["ms_median"] / r["ms_median"])
        assert r["cache_ratio_model_dtype"] == pytest.approx(full_cache_bytes(fp, n, b, dtype=None) / r["cache_bytes"])
        # the measured bytes equal the memory model's count and stay within its bound
        assert r["cache_matches_model"] and r["cache_within_bound"]
        assert r["cache_bytes"] == r["model_cache_bytes"] <= r["cache_bound_bytes"]
        if method == "full_eager":
            assert r["cache_bytes"] == full_cache_bytes(fp, n, b, dtype=None) == r["cache_bound_bytes"]
    assert rows[("full_eager", 96, 3)]["cache_bytes"] == 3 * rows[("full_eager", 96, 1)]["cache_bytes"]


def test_fit_rows_under_the_cap(result):
    fit = result["fit"]
    assert [(f["method"], f["tokens"]) for f in fit] == [(m, n) for m in ("full_eager", "moend_eager")
                                                         for n in (64, 96)]
    for f in fit:
        assert f["cap_bytes"] == 50 * 10**6 and f["basis"] == BASIS
        assert f["bytes_at_largest_batch"] <= f["cap_bytes"]
        per = f["cache_bytes_per_sequence"] + f["workspace_bytes_per_sequence"]
        assert f["bytes_at_largest_batch"] + per > f["cap_bytes"]  # one more sequence would not fit (full: linear)
    assert result["meta"]["memory_cap_bytes"] == 50 * 10**6


def test_markdown_json_and_old_rows(result, tmp_path):
    paths = D.write_decode(result, tmp_path)
    md = paths["markdown"].read_text()
    main_table = md.split("Throughput by batch")[0]
    assert main_table.count("| full_eager |") == 2  # the batch-1 table is unchanged: batch 1 rows only
    assert "| full_eager | 96 | 3 |" in md and "| moend_eager | 96 | 3 |" in md
    assert "in 6/6 rows" in md and "predicted from the memory model (not measured)" in md
    assert "Largest batch under a 50.00 MB memory cap" in md
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
    back = json.loads(paths["json"].read_text())
    again = D.add_ratios(back)
    assert [r["speedup_vs_baseline"] for r in again["rows"]] == [r["speedup_vs_baseline"] for r in result["rows"]]
    # a result written before batches existed (no "batch", no "tokens_per_s") still renders as batch 1
    for r in back["rows"]:
        r.pop("batch"), r.pop("tokens_per_s")
    back["rows"] = [r for r in back["rows"] if r["tokens"] == 64]
    old = D.add_ratios(back)
    assert all(r["batch"] == 1 and r["tokens_per_s"] > 0 for r in old["rows"])
    assert "Throughput by batch" not in D.markdown_table(old)


def test_steps_that_compile_are_left_out_of_the_median(model):
    """warm-up 0: the first measured step compiles the decode graph (the eager inner compiler: seconds)."""
    settings = D.DecodeBenchSettings(lengths=(96,), steps=3, warmup=0, methods=("moend_compiled",), inner="eager")
    res = D.bench_decode(model, settings, progress=False)
    for r in res["rows"]:
        assert r["status"] == "ok", r
        assert r["step_graphs"][0] >= 1 and r["compiled_steps"] >= 1
        assert r["graphs_compiled"] == sum(r["step_graphs"])  # no warm-up steps
        clean = [t for t, g in zip(r["step_ms"], r["step_graphs"]) if not g] or r["step_ms"]
        assert r["ms_median"] == pytest.approx(statistics.median(clean))
    assert "left out of the median: moend_compiled @ 96:" in D.markdown_table(res)


def test_no_cap_no_fit(model):
    res = D.bench_decode(model, D.DecodeBenchSettings(lengths=(64,), steps=1, warmup=0, methods=("full_eager",)),
                         progress=False)
    assert res["fit"] is None and res["rows"][0]["batch"] == 1
    assert "Largest batch" not in D.markdown_table(res)


@pytest.mark.parametrize("text, value", [("1", (1,)), ("1,4,8,16", (1, 4, 8, 16)), (" 2, 3 ", (2, 3))])
def test_parse_batches(text, value):
    assert D.parse_batches(text) == value


@pytest.mark.parametrize("text", ["", "0", "1,-4", "1,x", "1,1", "2.5"])
def test_bad_batches(text):
    with pytest.raises(MoendError) as e:
        D.parse_batches(text)
    assert f"--batches={text!r} is invalid" in str(e.value) and "1,4,8,16" in str(e.value)


@pytest.mark.parametrize("kw, words", [
    (dict(batches=()), ["batches=[]", "1,4,8,16"]),
    (dict(batches=(1, 1)), ["batches=[1, 1]"]),
    (dict(batches=(0,)), ["batch size=0"]),
    (dict(batch_lengths=(4096,), lengths=(2048,)), ["batch_lengths=[4096]", "[2048]"]),
    (dict(memory_cap="8 gigs"), ["'8 gigs'", "8GB", "GiB"]),
])
def test_bad_settings(kw, words):
    with pytest.raises(MoendError) as e:
        D.DecodeBenchSettings(**kw)
    for w in words:
        assert w in str(e.value)


def test_settings_round_trip():
    s = D.DecodeBenchSettings(batches=(1, 4), batch_lengths=(4096,), memory_cap="8GB")
    assert D.DecodeBenchSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert s.batches_at(4096) == (1, 4) and s.batches_at(2048) == (1,) and s.memory_cap_bytes == 8 * 10**9


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bench_batches")
    save_tiny_folder(path, "llama-gqa3-hd64")
    return path


def test_cli_batches_and_cap(folder, tmp_path, capsys):
    out = tmp_path / "res"
    code = main(["bench", "decode", "--model", str(folder), "--lengths", "48", "--steps", "1", "--warmup", "0",
                 "--methods", "full_eager", "--batches", "1,2", "--memory-cap", "40MB", "--threads", "1",
                 "--out", str(out), "--doc", "", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads((out / "decode" / "decode.json").read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert result["meta"]["settings"]["memory_cap"] == "40MB" and result["fit"][0]["largest_batch"] > 0
    assert "| full_eager | 48 | 2 |" in printed
    assert "moend bench decode" in (out / "sections" / "decode.json").read_text()


@pytest.mark.parametrize("argv, words", [
    (["--batches", "1,0"], ["--batches='1,0'", "1,4,8,16"]),
    (["--batches", "1,1"], ["--batches='1,1'"]),
    (["--batch-lengths", "4096x"], ["--batch-lengths='4096x'"]),
    (["--lengths", "2048", "--batch-lengths", "4096"], ["batch_lengths=[4096]", "[2048]"]),
    (["--memory-cap", "8 gigs"], ["'8 gigs'", "8GB", "GiB"]),
    (["--memory-cap", "14x"], ["'14x'", "allowed"]),
    (["--compile-times", "--methods", "full_eager,moend_eager"], ["--compile-times", "moend_compiled"]),
])
def test_cli_user_errors_are_one_line(argv, words, capsys):
    code = main(["bench", "decode", *argv, "--doc", ""])
    err = capsys.readouterr().err.strip()
    assert code == 2
    last = err.replace("\r", "\n").splitlines()[-1]
    assert last.startswith("moend: error:") and "Traceback" not in err
    for w in words:
        assert w in last, last
