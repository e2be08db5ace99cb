"""MoENDCache.from_prefill / MoENDLayer.load_prefill: a cache built from a full-precision DynamicCache prefill
(plus the recorded query windows) equals the cache a prefill through the "moend" attention function leaves.

Exact equality holds: both paths run the same SDPA prefill (same K/V bit for bit), then the same eviction
and quantization code on the same inputs; decode then runs the same code on both caches.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.common.errors import MoendError
from moend_fx.eval.steps import prefill
from moend_fx.eviction.rope import rope_from_model
from moend_fx.models import tiny_model
from moend_fx.plan.memory import keep_count, plan_layer_bytes
from moend_fx.plan.routing import LayerConfig
from tests.cache.test_moend_cache import _ids, _moend, _plan

# some layers evict (one below the 36-token floor at T=150), some only quantize, one is lossless
LOSSY = [LayerConfig(0.25, 4, 8), LayerConfig(0.5, 16, 16), LayerConfig(1.0, 4, 4), LayerConfig(0.1, 8, 2)]
T = 150


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)


def _layer_state(cache: MoENDCache) -> list[tuple]:
    """What each layer stores: positions, dequantized K/V, residual lengths, logical length."""
    out = []
    for layer in cache.layers:
        p = layer.packed
        k, v = p.dequantize()
        out.append((p.positions, k, v, p.num_packed, layer.logical))
    return out


def _assert_same(a: MoENDCache, b: MoENDCache) -> None:
    assert a.held_tokens() == b.held_tokens()
    assert a.nbytes() == b.nbytes() == a.model_bytes()
    for i, (x, y) in enumerate(zip(_layer_state(a), _layer_state(b))):
        assert (x[0] is None) == (y[0] is None), i
        if x[0] is not None:
            assert torch.equal(x[0], y[0]), f"layer {i}: different kept positions"
        assert torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]), f"layer {i}: different K/V"
        assert x[3:] == y[3:], i


@torch.no_grad()
def _greedy(model, cache: MoENDCache, first: torch.Tensor, steps: int) -> list[int]:
    tok, out = first, []
    for _ in range(steps):
        tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        out.append(int(tok))
    return out


@pytest.mark.parametrize("scorer", ["trig", "snapkv"])
def test_from_prefill_equals_a_prefill_through_the_model(model, scorer):
    plan = _plan(model, LOSSY, context_length=2048)
    kw = dict(rope=rope_from_model(model), scorer=scorer, evict_every=4, budget_mode="ratio")
    ids = _ids(1, T, seed=5)
    state = prefill(model, ids[0].tolist(), window=32)  # DynamicCache prefill + recorded last 32 queries
    built = MoENDCache.from_prefill(plan, state.kv, state.queries, **kw)

    _moend(model)
    try:
        real = MoENDCache(plan, **kw)
        with torch.no_grad():
            first = model(ids, cache=real, use_cache=True).logits[:, -1:].argmax(-1)
        _assert_same(built, real)
        floor = plan.sink_tokens + plan.recent_tokens
        assert built.held_tokens() == [keep_count(T, c.keep_ratio, floor) for c in LOSSY]
        assert built.held_tokens()[3] == floor  # 0.1 x 150 = 15 < the floor
        # the plan's prediction, with this cache's scorer (no calibrated statistics: a query window instead)
        assert built.nbytes().total == sum(
            plan_layer_bytes(c, T, plan.fingerprint, group_size=plan.group_size, floor=floor, scorer=scorer,
                             calibrated=False) for c in LOSSY)
        assert built.get_seq_length() == real.get_seq_length() == T
        # 10 greedy steps, with evictions every 4 steps on both caches
        assert _greedy(model, built, first, 10) == _greedy(model, real, first, 10)
        _assert_same(built, real)
        # layer 1 (16-bit K) re-evicts token by token every 4 steps; layer 0 (K4) by whole packed groups, only
        # once a whole group is over its ratio (not within 10 steps), so the prompt's is its only eviction
        assert [built.layers[i].evictions for i in (0, 1)] == [real.layers[i].evictions for i in (0, 1)] \
            == [1, 1 + 10 // 4]
    finally:
        model.set_attn_implementation("sdpa")
    assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(state.kv, prefill(model, ids[0].tolist()).kv))


def test_from_prefill_takes_a_dynamic_cache_and_needs_no_queries_for_keynorm(model):
    plan = _plan(model, LOSSY)
    ids = _ids(1, 90, seed=2)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=dyn, use_cache=True)
    built = MoENDCache.from_prefill(plan, dyn, scorer="keynorm")
    _moend(model)
    try:
        real = MoENDCache(plan, scorer="keynorm")
        with torch.no_grad():
            model(ids, cache=real, use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    _assert_same(built, real)
    assert built.state_nbytes() == real.state_nbytes() == sum(layer.evictor.rope_offset.nbytes for layer in built.layers
                                                              if layer.config.evicts)  # keynorm keeps no queries


def test_load_prefill_batch_of_two_equals_each_row_alone():
    torch.manual_seed(0)
    b, hkv, h, t, d = 2, 2, 4, 80, 16
    k, v, q = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d), torch.randn(b, h, 32, d)
    m = tiny_model("llama", num_layers=1, num_heads=h, num_kv_heads=hkv, head_dim=d)
    plan = _plan(m, [LayerConfig(0.25, 4, 4)])
    both = MoENDCache.from_prefill(plan, [(k, v)], [q], scorer="snapkv")
    for r in range(b):
        alone = MoENDCache.from_prefill(plan, [(k[r:r + 1], v[r:r + 1])], [q[r:r + 1]], scorer="snapkv")
        assert torch.equal(both.layers[0].packed.positions[r], alone.layers[0].packed.positions[0])


def test_bad_inputs_raise_moend_errors_naming_the_value(model):
    plan = _plan(model, LOSSY)
    b, hkv, t, d = 1, 2, 40, 16
    k, v, q = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d), torch.randn(b, 4, 8, d)
    kv = [(k, v)] * 4
    qs = [q] * 4
    kw = dict(scorer="snapkv")
    with pytest.raises(MoendError, match="4 layers; got 3 entries"):
        MoENDCache.from_prefill(plan, kv[:3], qs, **kw)
    with pytest.raises(MoendError, match="queries must be None or hold one tensor"):
        MoENDCache.from_prefill(plan, kv, qs[:2], **kw)
    with pytest.raises(MoendError, match=r"kv\[1\] keys \(1, 3, 40, 16\) must be \[B, Hkv=2, T, D=16\]"):
        MoENDCache.from_prefill(plan, [(k, v), (torch.randn(1, 3, t, d), v)] + kv[2:], qs, **kw)
    with pytest.raises(MoendError, match=r"values \(1, 2, 40, 8\) must be \[B, Hkv=2, T, D=16\]"):
        MoENDCache.from_prefill(plan, [(k, v[..., :8])] + kv[1:], qs, **kw)
    with pytest.raises(MoendError, match=r"keys \(1, 2, 40, 16\) and values \(1, 2, 39, 16\) must have the same"):
        MoENDCache.from_prefill(plan, [(k, v[:, :, :39])] + kv[1:], qs, **kw)
    with pytest.raises(MoendError, match="same batch and tokens as layer 0"):
        MoENDCache.from_prefill(plan, kv[:3] + [(k[:, :, :30], v[:, :, :30])], qs, **kw)
    with pytest.raises(MoendError, match=r"queries\[0\] \(1, 2, 8, 16\) must be \[B, H=4"):
        MoENDCache.from_prefill(plan, kv, [q[:, :2]] + qs[1:], **kw)
    with pytest.raises(MoendError, match=r"1 <= W <= T=40"):
        MoENDCache.from_prefill(plan, kv, [torch.randn(b, 4, 41, d)] + qs[1:], **kw)
    with pytest.raises(MoendError, match=r"B=1, H, W, D=16"):
        MoENDCache.from_prefill(plan, kv, [torch.randn(2, 4, 8, d)] + qs[1:], **kw)
    with pytest.raises(MoendError, match="needs the prompt's last queries"):
        MoENDCache.from_prefill(plan, kv, **kw)
    with pytest.raises(MoendError, match=r"kv\[0\] must be a \(keys, values\) pair"):
        MoENDCache.from_prefill(plan, [k] * 4, qs, **kw)
    cache = MoENDCache.from_prefill(plan, kv, qs, **kw)
    with pytest.raises(MoendError, match="needs an empty layer"):
        cache.layers[0].load_prefill(k, v, q)
    cache.layers[0].reset()
    cache.layers[0].load_prefill(k, v, q)  # a reset layer takes a prompt again
