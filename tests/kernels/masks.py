"""Padding masks for the kernel tests: bool [B, 1 or H, L, n] (True = may attend), as a left-padded batch gives them.

Kinds: "left" (row b's first p_b tokens hidden, p_b random in 0..n, so a row may hide everything), "random"
(every token hidden with probability 0.3), "per_head" (left padding plus random holes per query head: what an
evicting layer's mask gathered at each head's kept slots looks like).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

KINDS = ("left", "left", "random", "per_head")  # left padding is the common case


def padding_mask(seed: int, b: int, h: int, l: int, n: int, kind: str) -> torch.Tensor:
    """bool [B, 1, L, n] ("left", "random") or [B, H, L, n] ("per_head"), drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    heads = h if kind == "per_head" else 1
    if kind == "random":
        return torch.rand(b, 1, l, n, generator=gen) > 0.3
    pads = torch.randint(0, n + 1, (b,), generator=gen)
    mask = (torch.arange(n) >= pads[:, None]).reshape(b, 1, 1, n).expand(b, heads, l, n).clone()
    if kind == "per_head":
        mask &= torch.rand(b, heads, l, n, generator=gen) > 0.3
    return mask


@st.composite
def mask_kinds(draw) -> tuple[str, int]:
    """(kind, seed) for :func:`padding_mask`."""
    return draw(st.sampled_from(KINDS)), draw(st.integers(0, 2**16))


def with_causal(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """``mask`` AND the bottom-right causal mask of its L queries over its n tokens (when ``causal`` and L > 1)."""
    l, n = mask.shape[-2:]
    if not causal or l == 1:
        return mask
    return mask & torch.ones(l, n, dtype=torch.bool).tril(n - l)
