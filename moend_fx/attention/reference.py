"""Reference attention over a compressed layer: the oracle every fused path is tested against.

Plain torch: dequantize the whole layer, expand GQA, softmax in fp32. Obviously right, not fast.
"""

from __future__ import annotations

import math

import torch

from moend_fx.common.errors import MoendError
from moend_fx.storage.packed import PackedKV


def chunk_causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> torch.Tensor:
    """[L, S] bool: query i (of the last L stored tokens) sees keys ``j <= S - L + i``.

    The mask is aligned bottom-right: the L queries are the newest L of the S stored tokens. (SDPA's
    ``is_causal=True`` aligns top-left, which is wrong for a chunk that follows a past.)
    """
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_queries)


def attention_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    causal_chunk: bool = True, mask: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q: [B, H, L, D] over k, v: [B, Hkv, S, D] (H a multiple of Hkv, GQA), in fp32.

    causal_chunk: the L queries are the last L of the S keys (bottom-right causal mask); ignored for L = 1.
    mask: optional bool [B, 1 or H, L, S] (True = may attend), e.g. left padding; combined with the above.
    softcap: logit soft-capping, ``softcap * tanh(logits / softcap)`` (Gemma 2's ``attn_logit_softcapping``).
    Returns [B, H, L, D] in q's dtype.
    """
    b, h, l, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise MoendError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if h % hkv:
        raise MoendError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = h // hkv
    # [B, Hkv, G, L, D] x [B, Hkv, 1, D, S]: the G query heads of a group share one K/V head.
    qf = q.float().reshape(b, hkv, g, l, d)
    logits = torch.matmul(qf, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    allowed = None
    if causal_chunk and l > 1:
        if l > s:
            raise MoendError(f"a chunk of {l} queries cannot be the last tokens of only {s} keys")
        allowed = chunk_causal_mask(l, s, q.device)
    if mask is not None:
        m = mask.reshape(b, -1, 1, l, s) if mask.shape[1] == 1 else mask.reshape(b, hkv, g, l, s)
        allowed = m if allowed is None else (m & allowed)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # A row with no allowed key (a padding query) gives NaN; make it 0 like SDPA's memory-efficient path.
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, v.float().unsqueeze(2))
    return out.reshape(b, h, l, d).to(q.dtype)


def reference_attention(
    q: torch.Tensor, layer: PackedKV, *, scale: float | None = None, causal_chunk: bool = True,
    mask: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q: [B, H, L, D] over every token held by ``layer`` (packed + residual).

    For a multi-token chunk, the chunk must already be appended to ``layer`` (its tokens are the newest L).
    softcap: logit soft-capping (:func:`attention_dense`).
    """
    k, v = layer.dequantize(torch.float32)
    return attention_dense(q, k, v, scale=scale, causal_chunk=causal_chunk, mask=mask, softcap=softcap)
