"""MoENDLayer.crop (moend_fx.cache.speculation): a recorded forward cropped back leaves the layer exactly as plain
one-by-one decoding of the kept tokens leaves it (same K/V/queries fed), the byte cap holds while a step is open,
and assisted generation / prompt lookup on a prepared model give plain greedy's tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import rope_from_model
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

H, HKV, D = 4, 2, 16
CONFIGS = [LayerConfig(0.5, 4, 8), LayerConfig(1.0, 8, 16), LayerConfig(0.75, 16, 2), LayerConfig(1.0, 16, 16)]


def _model(**kw):
    return tiny_model("llama", num_layers=2, num_heads=H, num_kv_heads=HKV, head_dim=D, **kw)


FP = ModelFingerprint.from_model(_model())


def _plan(cfg: LayerConfig, context_length: int = 256, group_size: int = 8) -> RoutingPlan:
    return RoutingPlan.uniform(cfg, FP, context_length, group_size=group_size)


def _kvq(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g),
            torch.randn(1, H, n, D, generator=g))


def _prefill(layer, k, v, q) -> None:
    layer.update(k, v)
    layer.finish_prefill(q, None)


def _step(layer, k, v, q) -> None:
    layer.update(k, v)
    layer.attend(q, None)


def _state(layer) -> dict:
    """Everything a later step reads: storage, lengths, the eviction state."""
    ev = layer.evictor
    return {"tensors": [t.clone() for t in layer.packed.tensors()], "logical": layer.logical, "held": layer.held,
            "steps": ev.decode_steps, "queries": ev.queries_seen, "evictions": ev.evictions,
            "window": [t.clone() for t in ev.window.tensors()], "evicting": ev.evicting}


def _same(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k not in ("tensors", "window")} == \
           {k: v for k, v in b.items() if k not in ("tensors", "window")}
    for key in ("tensors", "window"):
        assert len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key]):
            assert x.dtype == y.dtype and torch.equal(x, y)  # bit for bit: the same codes, scales, residual


def _pair(cfg, scorer, evict_every, mode="ratio", context_length=256):
    kw = dict(scorer=scorer, evict_every=evict_every, budget_mode=mode)
    return (MoENDCache(_plan(cfg, context_length), **kw).layers[0],
            MoENDCache(_plan(cfg, context_length), **kw).layers[0])


@given(cfg=st.sampled_from(CONFIGS), scorer=st.sampled_from(["snapkv", "keynorm"]), t=st.integers(12, 60),
       before=st.integers(0, 9), lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       drop=st.integers(0, 18), evict_every=st.integers(2, 5), seed=st.integers(0, 3))
def test_crop_equals_one_by_one_decoding_of_the_kept_tokens(cfg, scorer, t, before, lengths, drop, evict_every,
                                                            seed):
    """Ratio mode (evictions every few steps, groups of 8 filling inside the open steps): open steps of
    ``lengths`` tokens cropped by ``drop`` equal feeding the kept tokens one at a time, bit for bit."""
    total = sum(lengths)
    drop = min(drop, total)
    k, v, q = _kvq(t + before + total, seed)
    rec, ref = _pair(cfg, scorer, evict_every)
    for layer in (rec, ref):
        _prefill(layer, k[:, :, :t], v[:, :, :t], q[:, :, :t])
        for i in range(t, t + before):  # decode steps before recording
            _step(layer, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1])
    rec.activate_past_recording()
    rec.record_past = len(lengths)  # a drafter's round: that many forwards stay open until the crop
    s = t + before
    for n in lengths:
        _step(rec, k[:, :, s : s + n], v[:, :, s : s + n], q[:, :, s : s + n])
        s += n
    assert rec.get_seq_length() == t + before + total
    rec.crop(-drop)
    for i in range(t + before, t + before + total - drop):
        _step(ref, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1])
    assert rec.get_seq_length() == ref.get_seq_length() == t + before + total - drop
    _same(_state(rec), _state(ref))


@given(cfg=st.sampled_from(CONFIGS), t=st.integers(3, 50), drop=st.integers(0, 6), seed=st.integers(0, 3))
def test_a_recorded_prompt_cropped_is_a_prefill_of_the_kept_tokens(cfg, t, drop, seed):
    """Assisted decoding's first forward is prompt + candidates: cropped, it is the kept prompt's prefill."""
    drop = min(drop, t - 2)
    k, v, q = _kvq(t, seed)
    rec, ref = _pair(cfg, "snapkv", 4)
    rec.activate_past_recording()
    _prefill(rec, k, v, q)
    assert rec.held == t  # dense until its crop
    rec.crop(-drop)
    _prefill(ref, k[:, :, : t - drop], v[:, :, : t - drop], q[:, :, : t - drop])
    _same(_state(rec), _state(ref))


@given(cfg=st.sampled_from(CONFIGS[:3]), t=st.integers(40, 120), lengths=st.lists(st.integers(1, 8), min_size=3,
       max_size=12), seed=st.integers(0, 3))
def test_capacity_mode_holds_the_cap_while_steps_are_open(cfg, t, lengths, seed):
    """Capacity mode with a small plan (context 64): every open step first makes room for itself, so the layer's
    measured bytes stay within its cap after every update, attention and crop, and equal the memory model once
    cropped."""
    k, v, q = _kvq(t + sum(lengths), seed)
    layer = MoENDCache(_plan(cfg, context_length=64), scorer="snapkv").layers[0]
    cap = layer.budget.cap(batch=1, dtype=torch.float32)
    _prefill(layer, k[:, :, :t], v[:, :, :t], q[:, :, :t])
    layer.activate_past_recording()
    s = t
    for j, n in enumerate(lengths):
        layer.update(k[:, :, s : s + n], v[:, :, s : s + n])
        assert layer.nbytes() <= cap
        layer.attend(q[:, :, s : s + n], None)
        assert layer.nbytes() <= cap
        layer.crop(-(j % (n + 1)))  # drop 0..n of the step's tokens
        s = layer.get_seq_length()
        assert layer.nbytes() <= cap and layer.nbytes() == layer.model_nbytes()


@given(cfg=st.sampled_from(CONFIGS[:3]), mode=st.sampled_from(["ratio", "capacity"]), t=st.integers(20, 70),
       steps=st.integers(1, 40), seed=st.integers(0, 3))
def test_plain_decoding_on_a_recording_layer_is_plain_decoding(cfg, mode, t, steps, seed):
    """A returned cache still records (a second turn): each forward commits the open one first, so one-token steps
    leave the layer as a layer that never recorded, bit for bit (evictions every 3 steps; capacity: context 48)."""
    k, v, q = _kvq(t + steps, seed)
    rec, ref = _pair(cfg, "snapkv", 3, mode=mode, context_length=48)
    rec.activate_past_recording()
    for layer in (rec, ref):
        _prefill(layer, k[:, :, :t], v[:, :, :t], q[:, :, :t])
        for i in range(t, t + steps):
            _step(layer, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1])
    rec.crop(0)
    _same(_state(rec), _state(ref))


def test_crop_refuses_what_it_cannot_take_back():
    k, v, q = _kvq(40, 0)
    layer = MoENDCache(_plan(CONFIGS[0]), scorer="snapkv").layers[0]
    _prefill(layer, k[:, :, :30], v[:, :, :30], q[:, :, :30])
    layer.crop(0)  # nothing open: a no-op
    with pytest.raises(MoendError, match="cannot crop 1 tokens; only the 0 fed since the last crop"):
        layer.crop(-1)
    with pytest.raises(MoendError, match=r"crop\(3\) is invalid; allowed: an int <= 0"):
        layer.crop(3)
    layer.activate_past_recording()
    _step(layer, k[:, :, 30:33], v[:, :, 30:33], q[:, :, 30:33])
    with pytest.raises(MoendError, match="cannot crop 4 tokens; only the 3"):
        layer.crop(-4)
    layer.crop(-3)
    assert layer.get_seq_length() == 30


# ------------------------------------------------------------------ generate on a prepared model
def _ids(t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, t), generator=torch.Generator().manual_seed(seed))


class BudgetWatch(MoENDCache):
    """A MoENDCache that checks its measured bytes against its cap before and after every crop (before: with the
    open step; except assisted decoding's first forward, whose prompt stays dense until its crop, as a prefill's
    K/V are dense until compressed)."""

    def crop(self, tokens_to_remove: int) -> None:
        self.checks = getattr(self, "checks", 0) + 1
        if all(layer.open[0].before is not None for layer in self.layers):
            assert self.nbytes().total <= self.budget_bytes().total
        super().crop(tokens_to_remove)
        assert self.nbytes() == self.model_bytes() and self.nbytes().total <= self.budget_bytes().total


def _draft():
    draft = _model()
    draft.generation_config.num_assistant_tokens = 4  # candidates per step: at most 4 (5 tokens verified)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return draft


@pytest.mark.parametrize("mode", ["ratio", "capacity"])
@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_assisted_and_prompt_lookup_give_plain_greedy_tokens(mode, how):
    """Prompts of 80-94 tokens evicted to half at prefill, groups of 8 filling inside verify steps, no eviction
    during decoding (ratio: every 128 steps; capacity: a 256-token plan): the verified tokens equal plain greedy
    decoding's with the same plan, bit for bit (fp32 tiny model), and every crop keeps the budget."""
    torch.manual_seed(0)
    model = _model()
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 8), ModelFingerprint.from_model(model), 256, group_size=8,
                               scorer="snapkv")
    opts = dict(budget_mode=mode, evict_every=128)
    prepare(model, plan, **opts)
    extra = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"assistant_model": _draft()}
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    for seed in range(3):
        ids = _ids(80 + 7 * seed, seed)
        want = model.generate(ids, **kw)
        cache = BudgetWatch(plan, rope=rope_from_model(model), **opts)
        got = model.generate(ids, cache=cache, **extra, **kw)
        assert torch.equal(got, want), (seed, got[0, ids.shape[1]:].tolist(), want[0, ids.shape[1]:].tolist())
        assert cache.checks > 1 and all(layer.evictions == 1 for layer in cache.layers)  # the prompt's


@pytest.mark.parametrize("reserve", [0, 4])
def test_evictions_during_speculation_keep_the_budget(reserve):
    """A 64-token capacity plan that evicts every few decode steps, verify steps of up to 5 tokens: the measured
    bytes never exceed the budget, the open step included. With reserve=4 an open step always fits (plain decoding
    with the same reserve evicts at the same tokens, given the same K/V, and a verify step's rows attend as
    decoding does: the tokens are plain greedy's); with reserve=0 an open step that would not fit first evicts
    older tokens."""
    torch.manual_seed(0)
    model = _model()
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 8), ModelFingerprint.from_model(model), 64, scorer="snapkv")
    prepare(model, plan, reserve=reserve)
    cache = BudgetWatch(plan, rope=rope_from_model(model), reserve=reserve)
    out = model.generate(_ids(40, 1), cache=cache, assistant_model=_draft(), max_new_tokens=40, min_new_tokens=40,
                         do_sample=False, pad_token_id=0)
    assert out.shape == (1, 80) and cache.checks > 1 and cache.get_seq_length() == 79
    assert all(layer.evictions > 3 for layer in cache.layers)


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_evictions_and_groups_inside_verify_steps_keep_plain_greedy_tokens(how):
    """A 64-token capacity plan (K4/V8, groups of 32) that evicts every few decode steps, reserve=4, verify steps of
    up to 5 tokens: each row of a verify step attends what one-by-one decoding holds at its token (an eviction or
    a K group quantized inside the step is seen by the rows after it only), so the tokens are plain greedy's
    (fp32 tiny model, two prompts; without the per-row verify attention both differ, from tokens 14 / 4 and
    35 / 9)."""
    torch.manual_seed(0)
    model, draft = _model(), _model()
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 8), FP, 64, scorer="snapkv")
    prepare(model, plan, reserve=4)
    try:
        extra = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"assistant_model": draft}
        kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
        for seed in range(2):
            ids = torch.randint(3, 256, (1, 40 + 9 * seed), generator=torch.Generator().manual_seed(seed))
            want = model.generate(ids, **kw)
            cache = BudgetWatch(plan, rope=rope_from_model(model), reserve=4)
            got = model.generate(ids, cache=cache, **extra, **kw)
            assert torch.equal(got, want), (seed, got[0, ids.shape[1]:].tolist(), want[0, ids.shape[1]:].tolist())
            assert all(layer.evictions > 3 for layer in cache.layers)
    finally:
        unprepare(model)


@torch.no_grad()
def _chunk_vs_steps(model, ids: torch.Tensor, tokens: torch.Tensor) -> float:
    """Largest |logit| difference on SmolLM2 between feeding ``tokens`` [1, n] as one chunk and one by one after
    ids, both over a DynamicCache: the rounding scale a verify step's chunk has by itself."""
    from transformers import DynamicCache

    caches = [DynamicCache(config=model.config) for _ in range(2)]
    for c in caches:
        model(ids, cache=c, use_cache=True)
    chunk = model(tokens, cache=caches[0], use_cache=True).logits[0]
    steps = torch.cat([model(tokens[:, i : i + 1], cache=caches[1], use_cache=True).logits[0]
                       for i in range(tokens.shape[1])])
    return float((chunk - steps).abs().max())


@pytest.mark.slow
def test_prompt_lookup_on_smollm2_gives_plain_greedy_tokens(smollm2):
    """SmolLM2, a uniform 4x-ish plan (keep 0.5, K4/V4), a repetitive prompt prompt lookup can draft from: the
    tokens equal plain greedy's with the same plan, or differ first where plain greedy's top-2 margin is within 10x
    the logit rounding DynamicCache itself shows between a chunk and one-by-one decoding (a near-tie)."""
    model, tok = smollm2
    text = "The list of colours: red, green, blue, red, green, blue, yellow. " * 12 + "Repeat the list:"
    ids = tok(text, return_tensors="pt").input_ids
    plan = RoutingPlan.uniform(LayerConfig(0.5, 4, 4), ModelFingerprint.from_model(model), 512, scorer="snapkv")
    prepare(model, plan, reserve=3)
    try:
        kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
        want = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
        got = model.generate(ids, prompt_lookup_num_tokens=3, **kw)
    finally:
        unprepare(model)
    w, g = want.sequences[0, ids.shape[1]:], got[0, ids.shape[1]:]
    diff = (w != g).nonzero()
    if len(diff):
        i = int(diff[0])
        top = want.scores[i][0].topk(2).values
        scale = _chunk_vs_steps(model, ids, w[None, :4])
        assert float(top[0] - top[1]) < 10 * scale, (i, float(top[0] - top[1]), scale)


# ------------------------------------------------------------------ sliding-window layers (Gemma 3's local layers)
@functools.cache
def _gemma3_fingerprint() -> ModelFingerprint:
    from tests.cache.sliding_models import sliding_model

    return ModelFingerprint.from_model(sliding_model("gemma3_text"))


def _sliding_pair(cfg: LayerConfig, mode: str):
    from moend_fx.cache.sliding import sliding_layer

    fp = _gemma3_fingerprint()
    plan = RoutingPlan.uniform(cfg, fp, 64, group_size=8, scorer="snapkv")
    i = fp.sliding[0]
    return [sliding_layer(plan, i, budget_mode=mode, attention_fn=None) for _ in range(2)], fp


@given(cfg=st.sampled_from([LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 4), LayerConfig(0.5, 4, 8)]),
       mode=st.sampled_from(["ratio", "capacity"]), t=st.integers(5, 60), before=st.integers(0, 30),
       lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), drop=st.integers(0, 18), seed=st.integers(0, 3))
def test_a_sliding_layer_cropped_equals_one_by_one_decoding(cfg, mode, t, before, lengths, drop, seed):
    """A sliding layer (window 24) keeps its oldest tokens while steps are open, and the crop replays the kept
    tokens with the trim each decode step makes: bit for bit what one-by-one decoding of them leaves."""
    (rec, ref), fp = _sliding_pair(cfg, mode)
    total = sum(lengths)
    drop = min(drop, total)
    g = torch.Generator().manual_seed(seed)
    n = t + before + total
    k, v = (torch.randn(1, fp.num_kv_heads, n, fp.head_dim, generator=g) for _ in range(2))
    q = torch.randn(1, fp.num_heads, n, fp.head_dim, generator=g)
    for layer in (rec, ref):
        _prefill(layer, k[:, :, :t], v[:, :, :t], q[:, :, :t])
        for i in range(t, t + before):
            _step(layer, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1])
    rec.activate_past_recording()
    rec.record_past = len(lengths)
    s = t + before
    for m in lengths:
        _step(rec, k[:, :, s : s + m], v[:, :, s : s + m], q[:, :, s : s + m])
        s += m
    rec.crop(-drop)
    for i in range(t + before, n - drop):
        _step(ref, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1])
    assert rec.held <= rec.limit
    _same(_state(rec), _state(ref))


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_assisted_decoding_on_a_sliding_window_hybrid(how):
    """Tiny Gemma 3 (5 sliding layers of window 24, 1 global), prompts of 72-82 tokens, keep 0.5 (the sliding
    layers hold the last 11 tokens: narrower than the window, so a verify step's queries must be narrowed to what
    decoding holds at each), 16-bit K, 4-bit V, capacity mode at 256 tokens (no decode-time eviction): the
    verified tokens equal plain greedy decoding's with the same plan; every crop leaves each layer within its
    budget. (A K group quantized inside a verify step is seen quantized by the step's earlier queries, where
    decoding saw it at 16 bits: with quantized K the tokens can differ by a near-tie; docs/cache.md.)"""
    from tests.cache.sliding_models import WINDOW, sliding_model

    model = sliding_model("gemma3_text")
    draft = sliding_model("gemma3_text")
    draft.load_state_dict(model.state_dict())
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    plan = RoutingPlan.uniform(LayerConfig(0.5, 16, 4), ModelFingerprint.from_model(model), 256, group_size=8,
                               scorer="snapkv")
    prepare(model, plan)
    try:
        extra = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"assistant_model": draft}
        kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
        for seed in range(2):
            ids = torch.randint(3, 256, (1, 3 * WINDOW + 10 * seed), generator=torch.Generator().manual_seed(seed))
            want = model.generate(ids, **kw)
            cache = CropWatch(plan, rope=rope_from_model(model))
            got = model.generate(ids, cache=cache, **extra, **kw)
            assert torch.equal(got, want), (seed, got[0, ids.shape[1]:].tolist(), want[0, ids.shape[1]:].tolist())
            assert cache.checks > 1
    finally:
        unprepare(model)


class CropWatch(MoENDCache):
    """A MoENDCache whose every layer is within its budget and priced by the memory model after each crop."""

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.checks = getattr(self, "checks", 0) + 1
        assert self.nbytes() == self.model_bytes() and self.nbytes().total <= self.budget_bytes().total


@given(cfg=st.sampled_from(CONFIGS[:3]), sliding=st.booleans(), t=st.integers(12, 50), before=st.integers(0, 9),
       n=st.integers(2, 7), evict_every=st.integers(2, 4), seed=st.integers(0, 3))
def test_a_verify_steps_rows_are_what_one_by_one_decoding_computes(cfg, sliding, t, before, n, evict_every, seed):
    """A recorded step of n tokens (a verify step) returns, row by row, the attention one-by-one decoding of those
    tokens computes: a K group filled or an eviction due (every 2-4 steps) inside the step is seen only by the
    rows after it, as in decoding; a sliding layer's rows see its trimmed window. Same states, same one-row
    shapes: equal to float rounding (1e-6; the tensors are O(1))."""
    if sliding:
        (rec, ref), fp = _sliding_pair(cfg, "ratio")
        h, hkv, d = fp.num_heads, fp.num_kv_heads, fp.head_dim
    else:
        rec, ref = _pair(cfg, "snapkv", evict_every)
        h, hkv, d = H, HKV, D
    g = torch.Generator().manual_seed(seed)
    total = t + before + n
    k, v = (torch.randn(1, hkv, total, d, generator=g) for _ in range(2))
    q = torch.randn(1, h, total, d, generator=g)
    for layer in (rec, ref):
        _prefill(layer, k[:, :, :t], v[:, :, :t], q[:, :, :t])
        for i in range(t, t + before):
            _step(layer, k[:, :, i : i + 1], v[:, :, i : i + 1], q[:, :, i : i + 1])
    rec.activate_past_recording()
    s = t + before
    rec.update(k[:, :, s:], v[:, :, s:])
    got = rec.attend(q[:, :, s:], None)
    want = []
    for i in range(s, total):
        ref.update(k[:, :, i : i + 1], v[:, :, i : i + 1])
        want.append(ref.attend(q[:, :, i : i + 1], None))
    assert (got - torch.cat(want, dim=2)).abs().max() < 1e-6
    rec.crop(0)
    _same(_state(rec), _state(ref))  # and the layer itself is what decoding left
