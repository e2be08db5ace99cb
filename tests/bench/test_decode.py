"""Tests for moend_fx.bench.decode and moend_fx.bench.report: structure and arithmetic, never timings."""

from __future__ import annotations

import json

import pytest
import torch

from moend_fx.bench import decode as D
from moend_fx.bench import decode_run
from moend_fx.bench.report import KEYS, existing_blocks, render_results, write_section
from moend_fx.common.errors import MoendError
from moend_fx.models import is_compiled, tiny_preset
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

SMALL = dict(lengths=(64, 96), steps=2, warmup=1)


@pytest.fixture(scope="module")
def model():
    return tiny_preset("llama-gqa3-hd64")


@pytest.fixture(scope="module")
def result(model):
    settings = D.DecodeBenchSettings(methods=("full_eager", "moend_eager"), **SMALL)
    return D.bench_decode(model, settings, progress=False)


def test_rows_and_ratios(result, model):
    rows = {(r["method"], r["tokens"]): r for r in result["rows"]}
    assert set(rows) == {(m, n) for m in ("full_eager", "moend_eager") for n in (64, 96)}
    fp = ModelFingerprint.from_model(model)
    for (_method, n), r in rows.items():
        assert r["status"] == "ok" and r["ms_median"] > 0 and r["steps"] == 2
        assert r["seq_length_after"] == n  # the last measured step ran at exactly n tokens
        base = rows[("full_eager", n)]
        assert r["speedup_vs_baseline"] == pytest.approx(base["ms_median"] / r["ms_median"])
        assert r["roofline_ms"] == pytest.approx((result["meta"]["weight_bytes"] + r["cache_bytes"]) / 28e9 * 1e3)
        assert r["x_roofline"] == pytest.approx(r["ms_median"] / r["roofline_ms"])
        assert r["cache_ratio_16bit"] == pytest.approx(full_cache_bytes(fp, n) / r["cache_bytes"])
    for n in (64, 96):
        full = rows[("full_eager", n)]
        # DynamicCache holds every token in fp32: exactly the model-dtype full cache.
        assert full["cache_bytes"] == full_cache_bytes(fp, n, dtype=None)
        assert full["cache_ratio_model_dtype"] == pytest.approx(1.0)
        assert full["speedup_vs_baseline"] == pytest.approx(1.0)
        comp = rows[("moend_eager", n)]
        # keep 0.25 + 4-bit: far smaller storage; trig without calibrated stats also keeps (and counts) a window
        # of 32 queries, which on this tiny model is a large share
        assert comp["cache_bytes"] - comp["scratch_bytes"] < full["cache_bytes"] / 2
        assert 0 < comp["scratch_bytes"] < comp["cache_bytes"]
        assert comp["plan"] == "3x keep 0.25/K4/V4"


def test_markdown_json_png_written(result, tmp_path):
    paths = D.write_decode(result, tmp_path)
    assert set(paths) == {"json", "markdown", "plot"}
    back = json.loads(paths["json"].read_text())
    assert len(back["rows"]) == 4 and back["meta"]["baseline"] == "full_eager"
    md = paths["markdown"].read_text()
    assert md.count("| full_eager |") == 2 and md.count("| moend_eager |") == 2
    assert "keep 0.25 / K4 / V4" in md  # the hand-written plan is stated
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
    # ratios recompute identically from the stored JSON (string keys after the round trip)
    again = D.add_ratios(back)
    assert [r["speedup_vs_baseline"] for r in again["rows"]] == [r["speedup_vs_baseline"] for r in result["rows"]]


def test_failing_method_is_reported_not_raised(model, monkeypatch):
    real_setup = decode_run.setup_model

    def setup(model, m, settings, table):
        if m.compile_backend == "moend":
            raise RuntimeError("backend exploded\nsecond line")
        return real_setup(model, m, settings, table)

    monkeypatch.setattr(decode_run, "setup_model", setup)
    settings = D.DecodeBenchSettings(methods=("full_eager", "moend_compiled"), lengths=(64,), steps=1, warmup=0)
    res = D.bench_decode(model, settings, progress=False)
    bad = [r for r in res["rows"] if r["method"] == "moend_compiled"]
    assert len(bad) == 1 and bad[0]["status"] == "unavailable"
    assert bad[0]["reason"] == "setup failed: RuntimeError: backend exploded"
    assert "unavailable: setup failed" in D.markdown_table(res)
    assert model.config._attn_implementation == "sdpa"  # torn down: the model is as before
    assert not is_compiled(model)


def test_given_plan_is_used(model):
    fp = ModelFingerprint.from_model(model)
    plan = RoutingPlan.uniform(LayerConfig(0.5, 8, 4), fp, 64, calibrated=False)  # priced for no table
    res = D.bench_decode(model, D.DecodeBenchSettings(methods=("moend_eager",), lengths=(64,), steps=1, warmup=0),
                         plan=plan, progress=False)
    assert res["rows"][0]["plan"] == "3x keep 0.5/K8/V4"
    assert res["rows"][0]["speedup_vs_baseline"] is None  # no baseline in this run
    assert "given plan" in res["meta"]["plan_source"]


def test_eviction_options_reach_the_moend_caches(model):
    fp = ModelFingerprint.from_model(model)
    plan = RoutingPlan.uniform(LayerConfig(0.25, 4, 4), fp, 256, calibrated=False)  # priced for no table
    m = decode_run.DecodeMethod("moend_eager", True, None, {256: plan})
    fill = D.DecodeBenchSettings(methods=("moend_eager",), lengths=(256,), steps=6, warmup=0, evict_every=1,
                                 reevict="tokens")
    cache = decode_run.new_cache(model, m, 256, None, fill)
    assert {(layer.policy.evict_every, str(layer.policy.reevict)) for layer in cache.layers} == {(1, "tokens")}
    rows = {}
    for settings in (D.DecodeBenchSettings(methods=("moend_eager",), lengths=(256,), steps=6, warmup=0), fill):
        res = D.bench_decode(model, settings, plan=plan, progress=False)
        (row,) = res["rows"]
        ms = [t for t, g in zip(row["step_ms"], row["step_graphs"]) if not g]
        assert row["ms_mean"] == pytest.approx(sum(ms) / len(ms))
        assert row["cache_within_bound"]
        rows[settings.evict_every] = row
        assert f"room for min({settings.evict_every}, group size) tokens" in D.markdown_table(res)
        assert "| mean ms |" in D.markdown_table(res)
    # a layer that leaves room for one token holds more of its cap than one that leaves room for 32
    assert rows[1]["cache_bytes"] > rows[128]["cache_bytes"]


def test_a_chunked_prefill_leaves_the_one_pass_cache(model, monkeypatch):
    seen = []
    inner = decode_run.decode_steps
    monkeypatch.setattr(decode_run, "decode_steps", lambda m, cache, tok, *a, **k: seen.append(
        (tok.clone(), [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])) or inner(m, cache, tok,
                                                                                                     *a, **k))
    for chunk in (0, 24):  # 64 tokens in one forward, then in chunks of 24, 24 and 16
        D.bench_decode(model, D.DecodeBenchSettings(methods=("full_eager",), lengths=(64,), steps=1, warmup=1,
                                                    prefill_chunk=chunk), progress=False)
    (tok1, kv1), (tok2, kv2) = seen[0], seen[2]  # each run's first decode_steps call: right after the prefill
    assert torch.equal(tok1, tok2)
    for (k1, v1), (k2, v2) in zip(kv1, kv2):
        # the chunks attend to the same keys under the same causal mask; only the sums' order differs (fp32)
        assert k1.shape == k2.shape and k1.shape[2] > 48
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)


def test_results_without_a_mean_render_as_published(result):
    old = {**result, "rows": [{k: v for k, v in r.items() if k != "ms_mean"} for r in result["rows"]]}
    md = D.markdown_table(old)
    assert "mean ms" not in md and "| moend_eager | 64 |" in md


@pytest.mark.parametrize("kw, words", [
    (dict(methods=("full_eager", "nope")), ["'nope'", "full_inductor"]),
    (dict(methods=()), ["methods is empty"]),
    (dict(lengths=(0,)), ["context length=0"]),
    (dict(steps=0), ["steps=0"]),
    (dict(warmup=-1), ["warmup=-1"]),
    (dict(bandwidth_gbs=0), ["bandwidth_gbs=0"]),
    (dict(evict_every=0), ["evict_every=0"]),
    (dict(reevict="bytes"), ["reevict", "groups", "tokens"]),
    (dict(prefill_chunk=-1), ["prefill_chunk=-1"]),
])
def test_bad_settings(kw, words):
    with pytest.raises(MoendError) as e:
        D.DecodeBenchSettings(**kw)
    for w in words:
        assert w in str(e.value)


def test_lengths_checked_against_model(model):
    with pytest.raises(MoendError, match="max_position_embeddings=4096"):
        D.bench_decode(model, D.DecodeBenchSettings(lengths=(5000,), methods=("full_eager",)), progress=False)
    with pytest.raises(MoendError, match="too short"):
        D.bench_decode(model, D.DecodeBenchSettings(lengths=(10,), steps=16, methods=("full_eager",)),
                       progress=False)


def test_parse_methods():
    assert D.parse_methods("all") == D.METHODS
    assert D.parse_methods(" full_eager, moend_eager ") == ("full_eager", "moend_eager")
    with pytest.raises(MoendError, match="allowed"):
        D.parse_methods("fast")


def test_memory_helpers(model):
    wb = D.weight_bytes(model)
    # tied or not, every parameter storage counted once: at least the parameters' bytes / 2, at most all
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < wb <= params + sum(b.numel() * b.element_size() for b in model.buffers())
    rss = D.rss_bytes()
    assert rss is None or rss > 0
    kv, scratch = D.cache_nbytes(object())
    assert (kv, scratch) == (0, 0)
    assert D.all_cores() >= 1 and torch.get_num_threads() >= 1


# --------------------------------------------------------------------------------------------- results.md


def test_render_results_keeps_old_sections_and_orders_them(tmp_path):
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    res = tmp_path / "results"
    png = res / "decode" / "decode.png"
    png.parent.mkdir(parents=True)
    png.write_bytes(b"\x89PNG fake")
    write_section(res, "decode", "moend bench decode --out results", "| a | b |\n| 1 | 2 |", {"plot": png})
    render_results(res, doc)
    text = doc.read_text()
    blocks = existing_blocks(text)
    assert list(blocks) == list(KEYS)  # every section present, in the template's order
    assert "moend bench decode --out results" in blocks["decode"]
    assert "| 1 | 2 |" in blocks["decode"]
    # plots are copied beside the document (results folders are not committed) and linked relatively
    assert "](img/decode-decode.png)" in blocks["decode"]
    assert (doc.parent / "img" / "decode-decode.png").read_bytes() == png.read_bytes()
    assert "Not run yet" in blocks["solvers"] and "moend bench solvers" in blocks["solvers"]

    # A later run with a fresh results folder that re-ran only the solvers keeps the old decode section.
    res2 = tmp_path / "results2"
    write_section(res2, "solvers", "moend bench solvers --out results2", "solver table")
    render_results(res2, doc)
    blocks2 = existing_blocks(doc.read_text())
    assert blocks2["decode"] == blocks["decode"]
    assert "solver table" in blocks2["solvers"] and "moend bench solvers --out results2" in blocks2["solvers"]
    assert "Not run yet" in blocks2["kernels"]


def test_render_results_appends_hand_written_notes(tmp_path):
    doc = tmp_path / "docs" / "results.md"
    (doc.parent / "results-notes").mkdir(parents=True)
    (doc.parent / "results-notes" / "solvers.md").write_text("**Reading.** greedy is within 1% of exact.\n")
    res = tmp_path / "results"
    write_section(res, "solvers", "moend bench solvers --out results", "# Solvers\n\n## Gaps\n\n| gap | 0.9 |")
    render_results(res, doc)
    block = existing_blocks(doc.read_text())["solvers"]
    # the body's own headings sit below the section title (## ...), never as a second document title
    assert "\n### Solvers\n" in block and "\n#### Gaps\n" in block and "\n# Solvers" not in block
    assert block.index("| gap | 0.9 |") < block.index("**Reading.** greedy is within 1% of exact.")
    # a re-render (as `moend bench all` does) keeps them exactly once
    render_results(res, doc)
    assert doc.read_text().count("greedy is within 1% of exact") == 1


def test_write_section_rejects_unknown_key(tmp_path):
    with pytest.raises(MoendError, match="decode"):
        write_section(tmp_path, "speed", "moend bench speed", "x")
