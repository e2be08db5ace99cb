"""The simulated cache of ``moend bench heads`` (:mod:`moend_fx.bench.head_budgets`): KV heads of one layer holding
different token counts, which the cache itself cannot store yet.

The simulation: each head's kept tokens are quantized exactly as the cache quantizes them (``PackedKV.from_dense``
on that head's tokens, then dequantized), written back at their slots of a dense ``DynamicCache``, and the
attention function ``moend_headsim`` masks every token a head dropped and reads the tokens fed after the prompt as
the cache stores them on arrival (V quantized per token, K in the 16-bit residual window). Its bytes are those of a
ragged layout: per head, the memory model's bytes for that head's count (``layer_bytes``, K groups counted per head),
plus one int32 count per (row, head) of a layer whose heads differ. Bytes are storage only (codes, scales, residual
window, positions, counts; ``moend``'s measured bytes less its eviction state, which every variant would hold alike);
for ``uniform`` they equal the real cache's. Where it differs from the cache: the K of tokens fed after the prompt
(the question or the answer prefix, then the answer) stays 16-bit, while the cache quantizes its residual window once
it fills a group of 32 (the report says how often ``uniform`` and ``moend`` answer alike).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.common.checks import check_choice
from moend_fx.eval.methods import PrefillState
from moend_fx.eviction.head_budgets import head_counts, keep_mask
from moend_fx.plan.memory import layer_bytes
from moend_fx.plan.routing import LayerConfig, RoutingPlan
from moend_fx.storage.packed import PackedKV, slot_positions

HEADSIM_ATTN = "moend_headsim"
COUNT_BYTES = 4  # one int32 token count per (row, KV head) of a ragged layer

# layer index -> (prompt tokens T; bool [B, Hkv, T]: those each KV head still holds, or None for all; the layer's
# config; group size), while a simulation decodes
_LAYERS: dict[int, tuple[int, torch.Tensor | None, LayerConfig, int]] = {}

# --------------------------------------------------------------------------------------------- attention


def headsim_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA of query: [B, H, L, D] over key, value: [B, Hkv, S, D] as a simulated layer holds them (``_LAYERS``):
    each KV head's dropped prompt tokens masked, and the S - T tokens fed since the prompt with V quantized as the
    cache quantizes V on arrival (per token) and K rounded to the 16-bit residual window; HF's mask attention_mask:
    bool [B, 1, L, S] or None (plainly causal). Returns ([B, L, H, D], None) as HF expects."""
    b, h, n_q, _ = query.shape
    hkv, s = key.shape[1], key.shape[2]
    keep = torch.ones(b, hkv, s, dtype=torch.bool, device=query.device)
    if module.layer_idx in _LAYERS:
        t, held, cfg, group = _LAYERS[module.layer_idx]
        if held is not None:
            keep[..., :t] = held
        if t < s:  # what the cache's append stores: V packed per token, K in the 16-bit residual window
            tail = PackedKV.from_dense(key[:, :, t:], value[:, :, t:], LayerConfig(1.0, 16, cfg.v_bits), group)
            k_new, v_new = tail.dequantize(key.dtype)
            key, value = torch.cat([key[:, :, :t], k_new], 2), torch.cat([value[:, :, :t], v_new], 2)
    mask = keep.repeat_interleave(h // hkv, dim=1)[:, :, None, :]  # [B, H, 1, S]
    if attention_mask is not None:
        mask = mask & (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)
    elif n_q > 1:  # bottom-right causal: query i sees the first S - L + i + 1 tokens
        mask = mask & (torch.arange(s, device=query.device) <= torch.arange(s - n_q, s, device=query.device)[:, None])
    k, v = key.repeat_interleave(h // hkv, dim=1), value.repeat_interleave(h // hkv, dim=1)
    out = F.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype), attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HEADSIM_ATTN, headsim_attention)
    AttentionMaskInterface.register(HEADSIM_ATTN, sdpa_mask)


register()


@contextmanager
def simulated(layers: list[SimulatedLayer], plan: RoutingPlan) -> Iterator[None]:
    """``layers`` (with ``plan``'s configs) in force for ``moend_headsim`` inside the block."""
    _LAYERS.clear()
    _LAYERS.update({i: (x.keys.shape[2], x.keep, cfg, plan.group_size)
                    for i, (x, cfg) in enumerate(zip(layers, plan.layers))})
    try:
        yield
    finally:
        _LAYERS.clear()


# --------------------------------------------------------------------------------------------- simulation


@dataclass
class SimulatedLayer:
    """One layer as the simulation holds it: keys, values [B, Hkv, T, D] (the kept tokens as the cache would
    dequantize them), keep bool [B, Hkv, T] or None (every token), counts [B, Hkv] and its ragged bytes."""

    keys: torch.Tensor
    values: torch.Tensor
    keep: torch.Tensor | None
    counts: torch.Tensor
    nbytes: int


def simulate_layer(keys: torch.Tensor, values: torch.Tensor, config: LayerConfig, keep: torch.Tensor | None, *,
                   group_size: int) -> SimulatedLayer:
    """keys, values: [B, Hkv, T, D] of one prefilled layer; keep: bool [B, Hkv, T] (None: every token). Each
    (row, head)'s kept tokens are quantized as the cache quantizes a layer holding them (``PackedKV.from_dense``)."""
    b, hkv, t, d = keys.shape
    if keep is None:
        pk = PackedKV.from_dense(keys, values, config, group_size,
                                 torch.arange(t).expand(b, hkv, t) if config.evicts else None)
        k, v = pk.dequantize(keys.dtype)
        counts = torch.full((b, hkv), t)
        return SimulatedLayer(k, v, None, counts, _ragged_bytes(config, counts, t, d, keys.dtype, group_size))
    k, v = keys.clone(), values.clone()
    for i in range(b):
        for h in range(hkv):
            idx = keep[i, h].nonzero().flatten()
            pk = PackedKV.from_dense(keys[i:i + 1, h:h + 1, idx], values[i:i + 1, h:h + 1, idx], config, group_size,
                                     idx.view(1, 1, -1))
            kd, vd = pk.dequantize(keys.dtype)
            k[i, h, idx], v[i, h, idx] = kd[0, 0], vd[0, 0]
    counts = keep.sum(-1)
    return SimulatedLayer(k, v, keep, counts, _ragged_bytes(config, counts, t, d, keys.dtype, group_size))


def _ragged_bytes(config: LayerConfig, counts: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype,
                  group_size: int) -> int:
    """Storage of a layer whose (row, head) i holds counts[i] tokens: the memory model per head, plus the counts
    themselves when they differ."""
    total = sum(layer_bytes(config, tokens, kv_heads=1, head_dim=head_dim, group_size=group_size, dtype=dtype,
                            kept=int(c), slots=tokens, positions=config.evicts) for c in counts.flatten().tolist())
    return total + (counts.numel() * COUNT_BYTES if bool((counts != counts.flatten()[0]).any()) else 0)


def simulate(plan: RoutingPlan, state: PrefillState, variant: str, *, held: Sequence[int], alpha: float,
             moend_kw: dict[str, Any]) -> list[SimulatedLayer]:
    """Every layer of ``state`` compressed by ``plan``, layer i holding ``held[i]`` tokens per head on average
    (what the real cache holds after this prompt: in capacity mode a layer keeps room for the next tokens, so
    that can be below ``keep_count``): each head that many (``uniform``), or per-head counts of the same total
    (``ada``); tokens ranked by the scorer the real cache uses (same RoPE, statistics and query window)."""
    check_choice("variant", variant, ("uniform", "ada"))
    scorers = MoENDCache(plan, **moend_kw)  # only its layers' evictors: the scorer each layer ranks tokens with
    out = []
    for i, (cfg, (k, v)) in enumerate(zip(plan.layers, state.kv)):
        keep = None
        if cfg.evicts:
            ev = scorers.layers[i].evictor
            ev.observe(state.queries[i], state.length, None)
            scores = ev.scores(k, v, slot_positions(0, k.shape[2], k).long(), None, None)
            kw = dict(sink_tokens=plan.sink_tokens, recent_tokens=plan.recent_tokens)
            n = int(held[i])
            counts = head_counts(scores, n, alpha=alpha, **kw) if variant == "ada" else torch.full(k.shape[:2], n)
            keep = keep_mask(scores, counts, **kw)
        out.append(simulate_layer(k, v, cfg, keep, group_size=plan.group_size))
    return out
