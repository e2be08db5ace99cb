"""MoENDCache end to end on tiny random models (and one slow test on SmolLM2).

Token identity vs DynamicCache is asserted with greedy decoding: the moend path reads K/V from their 16-bit
storage (fp16 for these fp32 models), so decode logits differ by that rounding (~3e-5 on the tiny models, ~1e-2
on SmolLM2), below the argmax margins of these models; logits are compared with an explicit tolerance where
that matters.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from moend_fx.cache.layer import EvictionPolicy, MoENDLayer
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.common.errors import MoendError, PlanError
from moend_fx.eviction.rope import rope_from_model
from moend_fx.eviction.scorers import get_scorer
from moend_fx.models import tiny_model
from moend_fx.plan.memory import keep_count, keep_floor, layer_bytes, plan_layer_bytes
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.plan.scorer_state import scorer_state_bytes

LOSSLESS = LayerConfig(1.0, 16, 16)
FLOOR = 4 + 32  # an evicting layer keeps at least the plan's sinks + recent window (defaults)


def _model(kind: str = "gqa", **kw):
    if kind == "gqa":
        return tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, **kw)
    return tiny_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, **kw)


def _plan(model, configs, context_length: int = 256, **kw) -> RoutingPlan:
    fp = ModelFingerprint.from_model(model)
    configs = list(configs) if isinstance(configs, (list, tuple)) else [configs] * fp.num_layers
    return RoutingPlan(layers=tuple(configs), fingerprint=fp, budget_bytes=1, context_length=context_length, **kw)


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, n: int = 30, **kw) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=cache,
                          pad_token_id=0, **kw)[:, ids.shape[1]:]


@torch.no_grad()
def _decode(model, cache, ids: torch.Tensor, steps: int, every=None) -> None:
    """Prefill ``ids`` then feed ``steps`` greedy tokens one at a time; ``every(step)`` after each."""
    logits = model(ids, cache=cache, use_cache=True).logits
    for s in range(steps):
        tok = logits[:, -1:].argmax(-1)
        logits = model(tok, cache=cache, use_cache=True).logits
        if every is not None:
            every(s + 1)


def _moend(model):
    model.set_attn_implementation("moend")
    return model


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_lossless_plan_is_token_identical_to_dynamic_cache(kind):
    model = _model(kind)
    ids = _ids(1, 40)
    ref = _generate(model, ids, DynamicCache(config=model.config))
    _moend(model)
    got = _generate(model, ids, MoENDCache(_plan(model, LOSSLESS)))
    assert torch.equal(ref, got)


def test_lossless_logits_match_dynamic_cache_closely():
    model = _model()
    ids = _ids(1, 24)
    with torch.no_grad():
        c = DynamicCache(config=model.config)
        ref = [model(ids, cache=c, use_cache=True).logits[:, -1]]
        ref.append(model(ids[:, :1], cache=c, use_cache=True).logits[:, -1])
        _moend(model)
        c = MoENDCache(_plan(model, LOSSLESS))
        got = [model(ids, cache=c, use_cache=True).logits[:, -1]]
        got.append(model(ids[:, :1], cache=c, use_cache=True).logits[:, -1])
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)  # prefill is the same SDPA call
    # The decode step reads the prompt's K/V from their fp16 storage (2^-11 relative rounding per value): logits
    # move by ~3e-5 on this model, far below its argmax margins (the greedy tests above are token-identical).
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-4)


HETERO = [LayerConfig(0.5, 4, 8), LayerConfig(0.25, 8, 4), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 4, 4)]


def _expected_bytes(cache: MoENDCache, model, batch: int) -> list[int]:
    fp = ModelFingerprint.from_model(model)
    return [layer_bytes(layer.config, 0, kv_heads=fp.num_kv_heads, head_dim=fp.head_dim, batch=batch,
                        group_size=cache.plan.group_size, dtype=torch.float32, kept=layer.held)
            + scorer_state_bytes(layer.config, layer.logical, scorer=getattr(layer.scorer, "name", None),
                                 num_heads=fp.num_heads, head_dim=fp.head_dim, batch=batch,
                                 calibrated=getattr(layer.scorer, "calibrated", False))
            for layer in cache.layers]


def test_nbytes_equal_memory_model_after_prefill_and_300_decode_steps():
    model = _moend(tiny_model("llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16))
    plan = _plan(model, HETERO)
    cache = MoENDCache(plan, rope=rope_from_model(model), evict_every=128, budget_mode="ratio")
    t = 70
    _decode(model, cache, _ids(1, t), 0)
    assert cache.held_tokens() == [keep_count(t, c.keep_ratio, FLOOR) for c in HETERO]
    assert cache.nbytes().per_layer == _expected_bytes(cache, model, 1)
    assert cache.nbytes() == cache.model_bytes()
    _decode_more(model, cache, 300)
    # evictions at decode steps 128 and 256 (ratio of the tokens seen then), then 44 more tokens; a layer with
    # quantized K re-evicts whole packed groups (its codes stay exact), so it stays within one group over the ratio
    held = cache.held_tokens()
    for h, c in zip(held, HETERO):
        want = keep_count(t + 256, c.keep_ratio, FLOOR) + 44 if c.evicts else t + 300
        assert want <= h < want + (cache.plan.group_size if c.k_bits < 16 else 1), (c, h, want)
    assert cache.nbytes().per_layer == _expected_bytes(cache, model, 1)
    assert cache.get_seq_length() == t + 300


@torch.no_grad()
def _decode_more(model, cache, steps: int, every=None) -> None:
    tok = torch.tensor([[5]])
    for s in range(steps):
        tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if every is not None:
            every(s + 1)


@pytest.mark.parametrize("t", [6, 40])
def test_short_prompt_keeps_at_least_sinks_and_recent_window(t):
    """A plan solved for 2048 tokens (keep 0.1 = 205 there) on a short prompt keeps min(T, 4 + 32) tokens per
    evicting layer, and the memory model predicts exactly what the cache measures."""
    model = _moend(tiny_model("llama", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16))
    cfgs = [LayerConfig(0.1, 4, 8), LayerConfig(0.1, 16, 16), LayerConfig(0.1, 2, 4), LayerConfig(1.0, 4, 4)]
    plan = _plan(model, cfgs, context_length=2048)
    assert keep_floor(plan) == FLOOR
    cache = MoENDCache(plan, rope=rope_from_model(model), evict_every=8, budget_mode="ratio")
    _decode(model, cache, _ids(1, t), 0)
    assert cache.held_tokens() == [min(t, FLOOR)] * 3 + [t]
    assert cache.nbytes() == cache.model_bytes()
    # no calibrated statistics here: trig keeps a query window, which the prediction is told
    want_bytes = [plan_layer_bytes(c, t, plan.fingerprint, floor=FLOOR, calibrated=False) for c in cfgs]
    assert cache.nbytes().per_layer == want_bytes
    if t > FLOOR:  # exactly the sinks and the recent window survive
        want = list(range(4)) + list(range(t - 32, t))
        assert cache.layers[0].packed.positions[0, 0].tolist() == want

    def check(step: int) -> None:  # decode re-evictions (every 8 steps) never go below the floor either
        assert all(h >= min(t + step, FLOOR) for h in cache.held_tokens()[:3]), step

    _decode_more(model, cache, 40, check)
    assert cache.layers[1].evictions >= 1  # 16-bit K: token by token (the K4/K2 layers drop whole groups only)
    assert cache.nbytes() == cache.model_bytes()


def _drive_layer(layer: MoENDLayer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> None:
    layer.update(k, v)
    layer.finish_prefill(q, None)


@pytest.mark.parametrize("scorer", ["keynorm", "snapkv", "trig"])
def test_kept_tokens_carry_their_true_positions(scorer):
    """Keys encode their position in channel 0 (K stays 16-bit, so it survives exactly; V is 4-bit)."""
    torch.manual_seed(0)
    b, hkv, h, t, d = 2, 2, 4, 90, 16
    from moend_fx.eviction.rope import RopeSpec

    sc = get_scorer(scorer, rope=RopeSpec.default(d)) if scorer == "trig" else get_scorer(scorer)
    cfg = LayerConfig(0.25, 16, 4)
    layer = MoENDLayer(cfg, layer_idx=0, scorer=sc, policy=EvictionPolicy(evict_every=8, recent_tokens=4))

    def kv(start: int, n: int):
        k = torch.randn(b, hkv, n, d)
        k[..., 0] = torch.arange(start, start + n).float() / 1024  # exact in fp32; small, so it does not steer scores
        return k, torch.randn(b, hkv, n, d)

    k, v = kv(0, t)
    _drive_layer(layer, k, v, torch.randn(b, h, t, d))
    for step in range(40):
        k, v = kv(t + step, 1)
        layer.update(k, v)
        layer.attend(torch.randn(b, h, 1, d), None)
        held_k, _ = layer.packed.dequantize()
        pos = layer.packed.positions
        assert torch.equal(held_k[..., 0] * 1024, pos.float())
        assert bool((pos[..., 1:] > pos[..., :-1]).all())  # ascending, unique
    assert layer.evictions == 1 + 40 // 8
    # different heads keep different tokens (per-head eviction)
    assert not torch.equal(pos[:, 0], pos[:, 1])


def test_chunked_prefill_equals_one_shot_for_lossless_plan():
    model = _moend(_model())
    ids = _ids(1, 50)
    one = _generate(model, ids, MoENDCache(_plan(model, LOSSLESS)))
    chunked = _generate(model, ids, MoENDCache(_plan(model, LOSSLESS)), prefill_chunk_size=16)
    assert torch.equal(one, chunked)


def test_chunked_prefill_keeps_memory_bounded_and_ratio():
    model = _moend(_model())
    cfg = LayerConfig(0.25, 4, 4)
    cache = MoENDCache(_plan(model, cfg), rope=rope_from_model(model), budget_mode="ratio")
    peaks = []
    with torch.no_grad():
        for chunk in _ids(1, 200).split(32, dim=1):
            model(chunk, cache=cache, use_cache=True)
            peaks.append(max(cache.held_tokens()))
    assert cache.held_tokens() == [keep_count(200, 0.25)] * 2
    # after each chunk a layer holds at most its share of what it has seen so far
    assert all(p <= keep_count(32 * (i + 1), 0.25, FLOOR) for i, p in enumerate(peaks))
    assert cache.get_seq_length() == 200


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(r.shape[0] for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = r
        mask[i, t - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("cfg,scorer", [(LOSSLESS, None), (LayerConfig(0.5, 16, 16), "trig"),
                                        (LayerConfig(0.5, 16, 16), "snapkv")])
def test_left_padded_batch_matches_each_row_alone(cfg, scorer):
    model = _moend(_model())
    rows = [_ids(1, 48, seed=1)[0], _ids(1, 30, seed=2)[0]]
    ids, mask = _left_pad(rows)

    def new_cache():
        return MoENDCache(_plan(model, cfg), rope=rope_from_model(model), scorer=scorer, evict_every=8)

    batched = _generate(model, ids, new_cache(), attention_mask=mask)
    for i, r in enumerate(rows):
        alone = _generate(model, r[None], new_cache())
        assert torch.equal(batched[i], alone[0]), f"row {i}"


def test_beam_search_lossless_matches_dynamic_cache():
    model = _model()
    ids = _ids(1, 30)
    ref = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0,
                         cache=DynamicCache(config=model.config))
    _moend(model)
    got = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0,
                         cache=MoENDCache(_plan(model, LOSSLESS)))
    assert torch.equal(ref, got)


@torch.no_grad()
def _teacher_forced_logprob(model, cache, prompt: torch.Tensor, tokens: torch.Tensor) -> float:
    """Sum of log p(token) when ``tokens`` [n] follow ``prompt`` [1, T], fed one at a time through ``cache``."""
    logits = model(prompt, cache=cache, use_cache=True).logits[:, -1]
    total = 0.0
    for i, tok in enumerate(tokens):
        total += float(torch.log_softmax(logits.float(), dim=-1)[0, tok])
        if i + 1 < len(tokens):
            logits = model(tok.view(1, 1), cache=cache, use_cache=True).logits[:, -1]
    return total


def test_lossy_beam_search_reorders_every_cache_row_with_its_beam():
    """Beam search keeps 3 rows and reorders them every step (``reorder_cache``); each row's packed K/V, positions,
    query window and RoPE offset must follow its beam. Then every returned beam's score (length_penalty=0: the sum
    of its tokens' log-probs) equals that of its tokens fed alone through a fresh cache of the same plan, whose
    evictions (after the prompt, every 4 steps, trig scoring the query window) see only that beam's history."""
    model = _moend(_model())
    ids, n = _ids(1, 80), 12  # 80 tokens: 0.5 x 80 > the 36-token floor, so the prompt is evicted

    def new_cache():
        return MoENDCache(_plan(model, LayerConfig(0.5, 16, 8)), rope=rope_from_model(model), evict_every=4,
                          budget_mode="ratio")

    lossy = new_cache()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, num_beams=3, num_return_sequences=3,
                         length_penalty=0.0, do_sample=False, pad_token_id=0, cache=lossy,
                         return_dict_in_generate=True, output_scores=True)
    assert lossy.layers[0].evictions == 1 + (n - 1) // 4 and lossy.nbytes() == lossy.model_bytes()
    beams = out.sequences[:, ids.shape[1]:]
    assert beams.shape == (3, n) and len({tuple(b.tolist()) for b in beams}) == 3
    for beam, score in zip(beams, out.sequences_scores.tolist()):
        assert _teacher_forced_logprob(model, new_cache(), ids, beam) == pytest.approx(score, abs=1e-4)


def test_attention_fn_is_the_one_swap_point():
    from moend_fx.attention.reference import reference_attention

    calls = []

    def spy(q, layer, **kw):
        calls.append((tuple(q.shape), layer.num_tokens))
        return reference_attention(q, layer, **kw)

    model = _moend(_model())
    _decode(model, MoENDCache(_plan(model, LayerConfig(0.5, 8, 8)), rope=rope_from_model(model),
                              attention_fn=spy), _ids(1, 100), 3)
    assert len(calls) == 3 * 2  # decode steps x layers; the prefill runs SDPA on the dense prompt
    assert calls[0] == ((1, 4, 1, 16), 51)


def test_wrong_attention_implementation_is_a_clear_error():
    model = _model()  # sdpa
    cache = MoENDCache(_plan(model, LOSSLESS))
    with pytest.raises(MoendError, match="set_attn_implementation"):
        _decode(model, cache, _ids(1, 10), 1)


def test_bad_arguments_raise_moend_errors():
    model = _model()
    plan = _plan(model, LayerConfig(0.5, 4, 4))
    with pytest.raises(MoendError, match="budget_mode"):
        MoENDCache(plan, budget_mode="fixed")
    with pytest.raises(MoendError, match="rope"):
        MoENDCache(plan)  # trig needs RoPE
    with pytest.raises(MoendError, match="evict_every"):
        MoENDCache(plan, scorer="keynorm", evict_every=0)
    with pytest.raises(MoendError, match="scorer"):
        MoENDCache(plan, scorer="nope")
    with pytest.raises(MoendError, match="RoutingPlan"):
        MoENDCache("plan.json")
    MoENDCache(_plan(model, LOSSLESS))  # a lossless plan needs no scorer nor RoPE
    other = _model("mha")
    with pytest.raises(PlanError):
        _plan(model, LOSSLESS).check_model(other)
    cache = MoENDCache(_plan(model, LOSSLESS))
    with pytest.raises(MoendError, match="crop"):
        cache.crop(-1)


# ------------------------------------------------------------------------------------------ real model
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _passkey_prompt(tokenizer, key: int, n_tokens: int, depth: float) -> torch.Tensor:
    per = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False).input_ids)
    reps = max(1, (n_tokens - 60) // per)
    at = int(reps * depth)
    text = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            + PASSKEY_FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + PASSKEY_FILLER * (reps - at) + "What is the pass key? The pass key is")
    return tokenizer(text, return_tensors="pt").input_ids


def _generate_with_logits(model, ids, cache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens [B, n] and the logits [B, n, V] each was picked from."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=cache, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.slow
def test_real_model_passkey_full_cache_and_lossless_moend_match():
    """The lossless plan of this fp32 model stores K/V in fp16: its logits move by ~1e-2 at most (measured 1.0e-2
    and 7.2e-3 on these two prompts, logits up to ~39), below the greedy margins (the smallest: 4.4e-2)."""
    from moend_fx.models import load_model

    model, tok = load_model("smollm2-135m")
    for key, depth in ((68513, 0.3), (40291, 0.7)):
        ids = _passkey_prompt(tok, key, 2000, depth)
        model.set_attn_implementation("sdpa")
        full, full_logits = _generate_with_logits(model, ids, DynamicCache(config=model.config), 8)
        assert str(key) in tok.decode(full[0])
        model.set_attn_implementation("moend")
        got, logits = _generate_with_logits(model, ids, MoENDCache(_plan(model, LOSSLESS, context_length=2048)), 8)
        assert torch.equal(full, got)
        gap = (logits - full_logits).abs().max().item()
        print(f"passkey {key} at depth {depth}: largest logit difference {gap:.2e}")
        assert gap < 0.05


def test_a_filled_group_is_flushed_lazily_and_settle_restores_the_memory_model():
    """A decode step that fills a group of G leaves it in the residual (attended at full precision once); it is
    quantized before the next append, or by settle() / nbytes(), so the stored bytes equal the memory model."""
    model = _moend(_model())
    cache = MoENDCache(_plan(model, LayerConfig(1.0, 4, 8)))
    _decode(model, cache, _ids(1, 60), 4)  # 60 + 4 tokens: the 4th step fills the second group of 32
    layer = cache.layers[0]
    assert layer.packed.num_packed == 32 and layer.packed.k_res.shape[2] == 32
    assert cache.nbytes() == cache.model_bytes()  # nbytes settles first
    assert layer.packed.num_packed == 64 and layer.packed.k_res.shape[2] == 0


@pytest.mark.parametrize("v_bits", [8, 16])
def test_before_step_marks_every_growing_cache_tensor_dynamic_along_tokens(v_bits):
    """Every tensor whose token axis grows is marked; a V packed on arrival leaves its residual empty for good, and
    that one stays static (one symbol fewer per layer in the decode graph)."""
    model = _moend(_model())
    cache = MoENDCache(_plan(model, LayerConfig(0.5, 4, v_bits)), scorer="snapkv")
    _decode(model, cache, _ids(1, 70), 2)
    cache.before_step()
    tensors = [t for layer in cache.layers for t in layer.stored_tensors()]
    # codes, scale, zero of K; of V too when quantized, else its raw block; 2 residuals, positions, query window
    assert len(tensors) == 2 * (10 if v_bits < 16 else 8)
    marked = [t for t in tensors if 2 in getattr(t, "_dynamo_weak_dynamic_indices", ())]
    static = [t for t in tensors if all(t is not m for m in marked)]
    if v_bits < 16:
        assert [id(t) for t in static] == [id(layer.packed.v_res) for layer in cache.layers]
        assert all(t.shape[2] == 0 for t in static)
    else:
        assert not static


@pytest.mark.parametrize("fn", ["fused_layer_attention", "packed_layer_attention"])
def test_default_and_pattern_attention_give_the_references_tokens(fn):
    """The default attention_fn (the fused op eager, the fusable pattern traced) and the plain pattern (SDPA over
    the dequantized layer) give the fp32 reference's greedy tokens."""
    from moend_fx.attention import fused, packed
    from moend_fx.attention.reference import reference_attention

    model = _moend(_model())
    plan = _plan(model, LayerConfig(0.5, 4, 8))
    default = MoENDCache(plan, scorer="keynorm")
    assert default.layers[0].attention_fn is fused.fused_layer_attention
    chosen = MoENDCache(plan, scorer="keynorm", attention_fn=getattr(fused, fn, None) or getattr(packed, fn))
    ref = MoENDCache(plan, scorer="keynorm", attention_fn=reference_attention)
    assert torch.equal(_generate(model, _ids(2, 40), chosen), _generate(model, _ids(2, 40), ref))
