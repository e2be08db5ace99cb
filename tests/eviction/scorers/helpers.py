"""Inputs and naive references the scorer tests share."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from moend_fx.eviction.rope import RopeSpec, invert_rope, to_complex
from moend_fx.eviction.scorers import Scorer, get_scorer

# batch, KV heads and query heads per KV head of the property tests
SHAPES = dict(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.integers(1, 3))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64).to(dtype)


def positions(seed: int, b: int, hkv: int, t: int) -> torch.Tensor:
    """Non-contiguous increasing positions [B, Hkv, T], different per head (as after an eviction)."""
    gaps = torch.randint(1, 6, (b, hkv, t), generator=gen(seed))
    return gaps.cumsum(-1) - 1


def build(name: str, head_dim: int, **kw) -> Scorer:
    """Scorer ``name`` with its defaults; trig gets a RoPE of ``head_dim``."""
    if name == "trig":
        return get_scorer("trig", rope=RopeSpec.default(head_dim, theta=1000.0), **kw)
    return get_scorer(name, **kw)


def dense_attention_sums(queries, keys, kp, qp, scale):
    """Naive: repeat K to every query head, dense masked softmax, sum over queries: [B, H, T] float64."""
    h, hkv = queries.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(h // hkv, 1)
    kpos = kp.repeat_interleave(h // hkv, 1)
    logits = queries.double() @ k.transpose(-1, -2) * scale  # [B, H, W, T]
    if qp is not None:
        logits = logits.masked_fill(kpos[:, :, None, :] > qp[:, None, :, None], -math.inf)
    return torch.softmax(logits, -1).nan_to_num(0.0).sum(2)


def pool_naive(x: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Pool x [..., T] token by token over the window cut at the ends (no padding counted)."""
    r = kernel // 2
    out = torch.empty_like(x)
    for i in range(x.shape[-1]):
        win = x[..., max(0, i - r) : i + r + 1]
        out[..., i] = win.mean(-1) if mode == "avg" else win.amax(-1)
    return out


def trig_brute(keys, kp, qbar, eabs, spec, offsets, t_now):
    """Averaged logit from the explicit series on un-rotated keys, per query head, then group mean.

    keys [B, Hkv, T, D] post-RoPE; qbar [H, F] complex; eabs [H, F]; t_now [B]; returns [B, Hkv, T] float64.
    """
    b, hkv, t, d = keys.shape
    h = qbar.shape[0]
    g = h // hkv
    kpre = to_complex(invert_rope(keys.double(), kp, spec))  # [B, Hkv, T, F]
    w = torch.tensor(spec.inv_freq, dtype=torch.float64)
    s2 = spec.attention_scaling**2
    out = torch.zeros(b, hkv, g, t, dtype=torch.float64)
    for head in range(h):
        kv, gi = divmod(head, g)
        qf = qbar[head]
        for delta in offsets:
            tt = t_now[:, None, None].double() + delta  # [B, 1, 1]
            ang = w * (tt - kp[:, kv, :, None].double()) + qf.angle() - kpre[:, kv].angle()
            out[:, kv, gi] += s2 * (qf.abs() * kpre[:, kv].abs() * torch.cos(ang)).sum(-1) / len(offsets)
        out[:, kv, gi] += s2 * ((eabs[head] - qf.abs()) * kpre[:, kv].abs()).sum(-1)
    return out.mean(dim=2)
