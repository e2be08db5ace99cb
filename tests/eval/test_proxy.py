"""Proxy validation: continuation runs against compressed context K/V, KL, correlations, report."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from moend_fx.calibration.continuation import ContinuationKL
from moend_fx.calibration.pipeline import calibrate
from moend_fx.common.errors import MoendError, TableError
from moend_fx.eval.proxy import (
    ProxySettings,
    correlations,
    markdown_report,
    random_plans,
    spread_rows,
    validate_proxy,
    write_report,
)
from moend_fx.models import tiny_model
from moend_fx.plan.routing import Grid, LayerConfig

TINY = dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32)
GRID = Grid((0.25, 0.5, 1.0), (16, 4), (16, 4))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", **TINY, seed=1)


@pytest.fixture(scope="module")
def table(model):
    return calibrate(model, tokens=160, num_sequences=1, grid=GRID, gain_probe="keep0.5_k4_v4")


@pytest.fixture(scope="module")
def seq(model, table):
    ids = torch.randint(0, 256, (184,), generator=torch.Generator().manual_seed(4))
    return ContinuationKL(model, table, ids, 160, 64), ids


def test_lossless_plan_equals_full_forward(model, seq):
    s, ids = seq
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0, 160:].double(), -1)
    # continuation-only forward over captured K/V vs one forward over everything: fp32 reassociation only
    torch.testing.assert_close(s.ref_logp, full, rtol=0, atol=1e-5)
    assert s.kl((LayerConfig(1.0, 16, 16),) * 3) == 0.0  # identical computation: exactly zero


def test_kl_grows_with_compression(seq):
    s, _ = seq
    kls = [s.kl((LayerConfig(k, 16, 16),) * 3) for k in (1.0, 0.5, 0.25)]
    assert kls[0] == 0.0 and 0 < kls[1] < kls[2]
    assert s.kl((LayerConfig(1.0, 4, 4),) * 3) > 0


def _layer_outputs(model, s, plan):
    """Each decoder layer's output hidden states [1, M, hidden] over the continuation under ``plan``."""
    outs = []

    def keep(module, args, output):
        outs.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        s.log_probs(plan)
    finally:
        for h in hooks:
            h.remove()
    return outs


@pytest.mark.parametrize("layer", [1, 2])
def test_compression_of_one_layer_changes_only_later_layers(model, seq, layer):
    """Compressing layer ``layer`` leaves every earlier layer's output bit-identical (the continuation's
    queries there attend to the same K/V); that layer and the ones after it change, and so does the KL."""
    s, _ = seq
    lossless = (LayerConfig(1.0, 16, 16),) * 3
    plan = tuple(LayerConfig(0.25, 4, 4) if i == layer else c for i, c in enumerate(lossless))
    ref, got = _layer_outputs(model, s, lossless), _layer_outputs(model, s, plan)
    assert len(ref) == len(got) == 3
    for i in range(layer):
        assert torch.equal(got[i], ref[i]), f"layer {i} (before the compressed layer {layer}) changed"
    for i in range(layer, 3):
        assert not torch.equal(got[i], ref[i]), f"layer {i} (from the compressed layer {layer} on) did not change"
    assert s.kl(plan) > 0


def test_validate_proxy_end_to_end(model, table, tmp_path):
    settings = ProxySettings(sequences=2, tokens=160, continuation=16, random_plans=8, budgets=("2x", "4x"),
                             window=32)
    res = validate_proxy(model, None, table, settings)
    assert len(res["plans"]) == 10
    assert all(p["measured_kl"] >= 0 and len(p["kl_per_sequence"]) == 2 for p in res["plans"])
    assert res["correlation"]["all"]["n"] == 10
    # on a random-weight model the proxy is still informative (loose: tiny model, 2 sequences)
    assert res["correlation"]["all"]["spearman"] > 0.5
    j, m = write_report(res, tmp_path / "out")
    back = json.loads(j.read_text())
    assert back["settings"]["sequences"] == 2 and "Pearson" in m.read_text()
    assert "| all | 10 |" in markdown_report(res)


def test_random_plans_deterministic_and_varied(table):
    a = random_plans(table, 12, seed=3)
    assert a == random_plans(table, 12, seed=3)
    assert a != random_plans(table, 12, seed=4)
    losses = [table.predicted_loss(p) for _, p in a]
    assert max(losses) > 5 * min(losses) + 1e-9  # spans light to heavy


def test_spread_rows(table):
    rows = {r["config"]: r for r in spread_rows(table)}
    assert set(rows) == {"keep0.25_k16_v16", "keep1_k4_v16", "keep1_k16_v4"}  # the paper columns in GRID
    r = rows["keep0.25_k16_v16"]
    col = table.column(LayerConfig(0.25, 16, 16))
    assert r["ours"] == pytest.approx(col.max() / col.min()) and r["paper"] == 548.0
    loss = table.gain * col ** 2  # the tiny table has gains (the default): the spread of what a layer's error costs
    assert r["loss"] == pytest.approx(loss.max() / loss.min())


def test_report_names_the_predictor(model, table, tmp_path):
    import dataclasses

    settings = ProxySettings(sequences=1, tokens=160, continuation=16, random_plans=3, budgets=("2x",), window=32)
    res = validate_proxy(model, None, table, settings)
    assert res["predictor"].startswith("sum of gain * S^2") and "keep0.5_k4_v4" in res["predictor"]
    md = markdown_report(res)
    assert "predicted loss (sum of gain * S^2" in md and "ours, gain x S^2" in md
    plain = validate_proxy(model, None, dataclasses.replace(table, gain=None), settings)
    assert plain["predictor"] == "sum of S" and all(r["loss"] is None for r in plain["spread"])
    assert "(sum of S)" in markdown_report(plain) and "gain x S^2" not in markdown_report(plain)


def test_correlations():
    c = correlations([1, 2, 3, 4], [1, 4, 9, 16])
    assert c["spearman"] == pytest.approx(1.0) and 0.9 < c["pearson"] < 1.0
    assert math.isnan(correlations([1, 1, 1], [1, 2, 3])["pearson"])


def test_a_retrieval_tail_is_asked_of_the_held_out_text(model, table, monkeypatch):
    import moend_fx.eval.proxy as proxy

    asked = {}
    real = proxy.token_sequences

    def spy(*args, **kw):
        asked.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(proxy, "token_sequences", spy)
    res = validate_proxy(model, None, table, ProxySettings(sequences=1, tokens=96, continuation=16, tail=16,
                                                           random_plans=2, budgets=("2x",), window=16))
    assert asked["tail"] == 16 and asked["split"] == "heldout"
    assert res["settings"]["tail"] == 16 and "the last 16 a retrieval tail" in markdown_report(res)


def test_the_held_out_tail_follows_the_tables_calibration_text():
    from types import SimpleNamespace

    from moend_fx.eval.proxy import heldout_tail

    v4 = SimpleNamespace(calibration={"source": {"retrieval_tail_tokens": 64, "sequences_with_tail": 2}})
    plain = SimpleNamespace(calibration={"source": {"retrieval_tail_tokens": 0, "sequences_with_tail": 0}})
    assert heldout_tail(v4, ProxySettings()) == 64  # like for like: the table was calibrated on retrieval tails
    assert heldout_tail(plain, ProxySettings()) == 0
    assert heldout_tail(SimpleNamespace(calibration={}), ProxySettings()) == 0  # a table from before v4
    assert heldout_tail(v4, ProxySettings(tail=0)) == 0  # an explicit choice wins
    assert heldout_tail(v4, ProxySettings(continuation=32)) == 32  # inside the measured continuation


def test_bad_input(model, table):
    with pytest.raises(MoendError, match="sequences=0"):
        ProxySettings(sequences=0)
    with pytest.raises(MoendError, match="tail=65 is invalid; allowed: 0 to continuation=64"):
        ProxySettings(tail=65)
    assert ProxySettings(budgets=["2x", "4x"]).budgets == ("2x", "4x")  # with the default tail too
    other = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(TableError, match="num_layers"):
        validate_proxy(other, None, table, ProxySettings(sequences=1, tokens=64))


@pytest.mark.slow
def test_proxy_spearman_on_real_model():
    """SmolLM2-135M, reduced: calibrate on 1 x 1024 tokens, validate on 3 held-out x 1024 (+32) tokens with
    12 random plans + greedy plans at 6 budgets (the full run is 8 x 2048 + 64; see docs/calibration.md)."""
    from moend_fx.models import load_model

    model, tok = load_model("smollm2-135m")
    t0 = time.perf_counter()
    # Plain-text calibration, like the plain-text held-out set: this checks the proxy itself. The default
    # retrieval tail (calibration v4) rates layers by retrieved answers and ranks plain-text plans less well
    # (0.775 on this reduced set; 0.902 vs 0.972 on the published one, docs/calibration.md).
    tab = calibrate(model, tok, tokens=1024, num_sequences=1, retrieval_tails=0)
    settings = ProxySettings(sequences=3, tokens=1024, continuation=32, random_plans=12,
                             budgets=("2x", "3x", "4x", "6x", "8x", "12x"))
    res = validate_proxy(model, tok, tab, settings)
    rho = res["correlation"]["all"]["spearman"]
    print(f"spearman={rho:.3f} pearson={res['correlation']['all']['pearson']:.3f} "
          f"in {time.perf_counter() - t0:.0f}s")
    assert rho >= 0.8, res["correlation"]
    assert np.isfinite([p["measured_kl"] for p in res["plans"]]).all()
