"""``moend bench prefill``: settings checks, and one run on a tiny model folder (each mode in its own process).
Structure only, never timings."""

from __future__ import annotations

import json

import pytest

from moend_fx.bench.prefill import PrefillBenchSettings
from moend_fx.bench.report import existing_blocks
from moend_fx.cli import main
from moend_fx.common.errors import MoendError
from tests.models.helpers import save_tiny_folder


@pytest.mark.parametrize("kw, words", [
    ({"modes": ("one_shot", "fast")}, ["'fast'", "chunked"]),
    ({"length": 4096, "chunk": 4096}, ["chunk=4096", "length=4096"]),
    ({"chunk": 1}, ["chunk=1"]),
    ({"length": 10}, ["length=10"]),
    ({"malloc": "jemalloc"}, ["'jemalloc'", "fixed"]),
])
def test_bad_settings_raise(kw, words):
    with pytest.raises(MoendError) as err:
        PrefillBenchSettings(**kw)
    for w in words:
        assert w in str(err.value)


def test_bench_prefill_cli_on_a_tiny_model(tmp_path, capsys):
    folder = tmp_path / "tiny"
    save_tiny_folder(folder, "llama-gqa3-hd64")
    out, doc = tmp_path / "res", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    code = main(["bench", "prefill", "--model", str(folder), "--length", "200", "--chunk", "64", "--threads", "1",
                 "--out", str(out), "--doc", str(doc), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads((out / "prefill" / "prefill.json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["one_shot", "chunked"]
    one, chunked = result["rows"]
    assert (one["chunks"], chunked["chunks"]) == (1, -(-one["tokens"] // 64))
    for r in result["rows"]:
        assert r["prefill_s"] > 0 and r["peak_rss_growth"] >= 0 and r["baseline_rss"] > 0
        assert 0 < r["cache_bytes"] <= r["budget_bytes"]
    assert 0 <= result["cost"]["top1_agreement"] <= 1 and result["cost"]["mean_kl_first_token"] >= -1e-6
    assert "| chunked |" in printed and "Accuracy cost of chunking" in printed
    block = existing_blocks(doc.read_text())["prefill"]
    assert f"moend bench prefill --model {folder} --length 200 --chunk 64" in block
