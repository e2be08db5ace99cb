"""Long prompts in bounded memory: ``prepare(..., prefill_chunk=N)`` prefills a long prompt in chunks through HF's
own chunked prefill, each compressed before the next is fed (docs/cache.md, "Long prompts in bounded memory").

Tiny random models for the fast tests; one slow test on SmolLM2 (the ``smollm2`` fixture in tests/conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moend_fx.cache.masks as masks
from moend_fx.attention.reference import reference_attention
from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.layer import MoENDLayer
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.common.defaults import PREFILL_CHUNK, PREFILL_CHUNK_ABOVE
from moend_fx.common.errors import MoendError
from moend_fx.models import tiny_model
from moend_fx.plan.memory import keep_count, keep_floor, plan_bytes
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.storage.packed import PackedKV

LOSSLESS = LayerConfig(1.0, 16, 16)
# Chunk 2+ attends to the past K/V as the cache stores them, in 16 bits (fp16 for these fp32 models), where the
# one-shot prefill's SDPA reads the fp32 K/V: a relative rounding of 2^-11 on K/V moves these logits (|x| < 1) by
# ~3e-5 (measured); 1e-4 leaves room for the accumulation order of other BLAS builds.
LOGIT_TOL = 1e-4


def _model(max_positions: int = 4096):
    return tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=max_positions)


def _plan(model, cfg: LayerConfig, context_length: int = 256) -> RoutingPlan:
    """A uniform plan priced for the cache prepare builds here, with no table: trig estimating its query statistics
    from a query window (``calibrated=False``; prepare refuses a plan priced for another eviction state)."""
    plan = RoutingPlan.uniform(cfg, ModelFingerprint.from_model(model), context_length)
    used = plan_bytes(plan, calibrated=False)
    return dataclasses.replace(plan, budget_bytes=used, bytes_planned=used)


def _ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, t), generator=torch.Generator().manual_seed(seed))


def _gen(model, ids, n: int = 20, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **kw)


@pytest.fixture
def passes(monkeypatch):
    """The (kind, query length) of every attention call layer 0 gets: "prefill" for the staged prefill of an empty
    layer (SDPA, evict, compress), "attend" for a chunk or decode step over the packed storage."""
    seen: list[tuple[str, int]] = []
    finish, attend = MoENDLayer.finish_prefill, MoENDLayer.attend

    def spy_finish(self, query, *a, **k):
        if self.layer_idx == 0:
            seen.append(("prefill", query.shape[2]))
        return finish(self, query, *a, **k)

    def spy_attend(self, query, *a, **k):
        if self.layer_idx == 0 and query.shape[2] > 1:  # decode steps (one query) are not chunks
            seen.append(("attend", query.shape[2]))
        return attend(self, query, *a, **k)

    monkeypatch.setattr(MoENDLayer, "finish_prefill", spy_finish)
    monkeypatch.setattr(MoENDLayer, "attend", spy_attend)
    return seen


def test_lossless_chunked_prefill_feeds_chunks_through_the_cache_and_matches_one_shot(passes):
    model = _model()
    ids = _ids(70)
    prepare(model, _plan(model, LOSSLESS), prefill_chunk=None)
    one = _gen(model, ids)
    assert passes == [("prefill", 70)]
    passes.clear()
    prepare(model, _plan(model, LOSSLESS), prefill_chunk=16, prefill_chunk_above=16)
    chunked = _gen(model, ids)
    # the first chunk takes the staged-prefill path, the others are appended to the packed past and attend to it
    assert passes == [("prefill", 16), ("attend", 16), ("attend", 16), ("attend", 16), ("attend", 6)]
    assert torch.equal(one.sequences, chunked.sequences)
    for a, b in zip(one.logits, chunked.logits):
        assert (a - b).abs().max().item() < LOGIT_TOL


def test_defaults_chunk_only_prompts_longer_than_the_threshold(passes):
    assert (PREFILL_CHUNK, PREFILL_CHUNK_ABOVE) == (2048, 4096)
    model = _model(max_positions=8192)
    prepare(model, _plan(model, LOSSLESS))
    _gen(model, _ids(PREFILL_CHUNK_ABOVE), n=1)
    assert passes == [("prefill", PREFILL_CHUNK_ABOVE)]
    passes.clear()
    _gen(model, _ids(PREFILL_CHUNK_ABOVE + 1), n=1)
    # 2048 + 2048 + 1: the one-token tail is attended like a decode step (the spy leaves those out)
    assert passes == [("prefill", PREFILL_CHUNK), ("attend", PREFILL_CHUNK)]


def test_a_callers_chunk_size_wins_and_none_or_zero_turn_chunking_off(passes):
    model = _model()
    ids = _ids(40)
    prepare(model, _plan(model, LOSSLESS), prefill_chunk=16, prefill_chunk_above=0)
    out = _gen(model, ids, n=2, prefill_chunk_size=30)
    assert passes == [("prefill", 30), ("attend", 10)]
    assert out.cache.get_seq_length() == 41
    for off in (None, 0):
        passes.clear()
        prepare(model, _plan(model, LOSSLESS), prefill_chunk=off, prefill_chunk_above=0)
        _gen(model, ids, n=2)
        assert passes == [("prefill", 40)]
    unprepare(model)
    assert "_prefill" not in model.__dict__


def test_chunked_prefill_of_a_compressing_plan_stays_within_its_byte_budget(monkeypatch):
    model = _model()
    t, chunk = 300, 64
    plan = _plan(model, LayerConfig(0.25, 4, 4), context_length=t)
    after_chunk: list[tuple[list[int], list[int]]] = []
    before_step = MoENDCache.before_step

    def spy(self):  # prepare's generate hook calls it before every forward: each chunk's, then each decode step's
        before_step(self)
        after_chunk.append((self.nbytes().per_layer, self.model_bytes().per_layer))

    monkeypatch.setattr(MoENDCache, "before_step", spy)
    prepare(model, plan, prefill_chunk=chunk, prefill_chunk_above=0)
    out = _gen(model, _ids(t), n=4)
    cache = out.cache
    budget = cache.budget_bytes().per_layer
    n_chunks = -(-t // chunk)
    assert len(after_chunk) == n_chunks + 4 - 1  # before every chunk and every decode step but the first token's
    for measured, modelled in after_chunk:
        assert measured == modelled  # the memory model counts every stored byte, mid-prefill too
        assert all(m <= b for m, b in zip(measured, budget)), (measured, budget)
    assert cache.nbytes() == cache.model_bytes() and cache.nbytes().total <= cache.budget_bytes().total
    for layer in cache.layers:
        assert layer.evictions >= n_chunks  # each chunk re-evicted (the first one at its staged prefill)
        assert layer.held <= keep_count(t + 4, 0.25, keep_floor(plan)) + 4


def test_chunk_attention_drops_a_plainly_causal_mask_and_blocks_a_padded_one(monkeypatch):
    """held_attention over an evicted layer (per-head kept slots) holding a 20-token chunk after 30 kept past
    tokens: the mask-free call equals the gathered-mask call, and the row blocks of a padded mask equal one call."""
    gen = torch.Generator().manual_seed(0)
    b, hkv, h, d, s, n_q = 2, 2, 4, 16, 100, 20
    past = torch.stack([torch.randperm(s - n_q, generator=gen)[:30].sort().values for _ in range(b * hkv)])
    pos = torch.cat([past.view(b, hkv, 30), torch.arange(s - n_q, s).expand(b, hkv, n_q)], dim=-1)
    k, v = (torch.randn(b, hkv, 50, d, generator=gen) for _ in range(2))
    packed = PackedKV.from_dense(k, v, LayerConfig(0.5, 16, 16), 32, pos)
    q = torch.randn(b, h, n_q, d, generator=gen)
    causal = torch.ones(n_q, s, dtype=torch.bool).tril(s - n_q).expand(b, 1, n_q, s)
    calls = []

    def fn(q, packed, **kw):
        calls.append((q.shape[2], kw["mask"] is None))
        return reference_attention(q, packed, **kw)

    free = masks.held_attention(fn, q, packed, causal.clone(), None)
    gathered = reference_attention(q, packed, mask=masks.held_mask(causal, packed.positions, 50, h))
    assert calls == [(n_q, True)] and torch.allclose(free, gathered, atol=1e-6)
    padded = causal.clone()
    padded[1, :, :, :7] = False  # row 1 is left-padded by 7 slots
    one = masks.held_attention(fn, q, packed, padded, None)
    calls.clear()
    monkeypatch.setattr(masks, "CHUNK_SCORE_ELEMENTS", b * h * 50 * 6)  # blocks of 6 query rows
    blocked = masks.held_attention(fn, q, packed, padded, None)
    assert calls == [(6, False)] * 3 + [(2, False)]
    assert torch.allclose(one, blocked, atol=1e-6)


@pytest.mark.parametrize("kw, words", [
    ({"prefill_chunk": 1}, ["prefill_chunk=1", "None or 0", ">= 2"]),
    ({"prefill_chunk": -5}, ["prefill_chunk=-5", ">= 2"]),
    ({"prefill_chunk": 2048.0}, ["prefill_chunk=2048.0"]),
    ({"prefill_chunk": "2048"}, ["prefill_chunk='2048'"]),
    ({"prefill_chunk": True}, ["prefill_chunk=True"]),
    ({"prefill_chunk_above": -1}, ["prefill_chunk_above=-1", ">= 0"]),
    ({"prefill_chunk_above": None}, ["prefill_chunk_above=None"]),
])
def test_bad_prefill_chunk_options_raise_and_leave_the_model_alone(kw, words):
    model = _model()
    with pytest.raises(MoendError) as err:
        prepare(model, _plan(model, LOSSLESS), **kw)
    for w in words:
        assert w in str(err.value)
    assert model.config._attn_implementation == "sdpa" and "_prefill" not in model.__dict__


@pytest.mark.slow
def test_smollm2_chunked_prefill_keeps_the_passkey_within_budget(smollm2):
    """SmolLM2, a ~1.5k-token passkey prompt, a 12x plan solved for its length: prefilled in 512-token chunks
    (three re-evictions before the question is seen), the answer is the one-shot prefill's and the cache holds
    no more than the plan's bytes."""
    from moend_fx.eval.tasks import make_examples, score

    model, tok = smollm2
    ex = make_examples("passkey", tok, 1536, 1, seed=5)[0]
    ids = tok(ex.prompt_full, return_tensors="pt").input_ids
    plan = _plan(model, LayerConfig(0.25, 4, 4), context_length=ids.shape[1])
    texts, caches = [], []
    try:
        for chunk in (None, 512):
            prepare(model, plan, prefill_chunk=chunk, prefill_chunk_above=0)
            out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=tok.eos_token_id)
            texts.append(tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
            caches.append(out.cache)
    finally:
        unprepare(model)
    assert score(ex, texts[0]) == 1.0 and score(ex, texts[1]) == 1.0, texts
    for cache in caches:
        assert cache.nbytes() == cache.model_bytes() and cache.nbytes().total <= cache.budget_bytes().total
