"""How far the fused CPU kernel (``moend_attn.cpp``) may sit from the reference attention, and why.

The kernel dots the K codes against the query folded with the group's scales, ``q*s``, rounded to int16 per
query row and K group: ``q*s ~= deq * qi`` with ``deq = max|q*s| / QMAX``. Each logit then carries the sum of
D independent rounding errors ``e_d * c_td`` (``|e_d| <= deq / 2``), whose standard deviation is
``sigma = deq * ||c_t|| / sqrt(12)``. A logit error ``delta`` moves the output by at most
``sum_t |dp_t| * max|v| <= 2 * max|delta| * max|v|``. The bound used is ``|delta| <= 3 sigma`` (a 3-sigma
excursion of the largest sum), plus the fp32 reordering allowance of the float paths (``1e-5``: online
softmax, block sums, polynomial exp with relative error ~1e-7). Over the (bits, head_dim, GQA) grid on this
data the largest measured error is ~0.2 of ``2 * sigma * max|v|``, i.e. ~15x inside this bound, while a real
bug (a permuted channel, a dropped zero term, a wrong group scale) moves outputs by >= 1e-1.
A 16-bit K side has no int16 step (sigma = 0): those cases keep the plain fp32 tolerance.
"""

from __future__ import annotations

import math

import torch

from moend_fx.storage.packed import PackedKV
from moend_fx.storage.quant import unpack

FP32_ATOL, FP32_RTOL = 1e-5, 1e-4  # the float paths: summation order only
QMAX = 32639  # the kernel's int16 query range (moend_attn.cpp, fill_shapes: 127 * 256 + 127 for the VNNI halves)


def int16_logit_sigma(q: torch.Tensor, layer: PackedKV, scale: float | None = None) -> float:
    """Largest ``deq * ||c_t|| / sqrt(12)`` over the layer's K groups, KV heads and query rows (0 if K is 16-bit)."""
    kp = layer.k_packed
    d = q.shape[-1]
    if isinstance(kp, torch.Tensor) or kp.codes.shape[2] == 0:
        return 0.0
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    b, h = q.shape[:2]
    hkv = kp.codes.shape[1]
    codes = unpack(kp.codes, kp.bits, d).float()  # [B, Hkv, P, D]
    cnorm = codes.norm(dim=-1).amax(-1)  # [B, Hkv]: max_t ||c_t||
    qs = (q.float() * scale).reshape(b, hkv, h // hkv, -1, 1, d).abs()  # [B, Hkv, Gq, L, 1, D]
    s = kp.scale.float()[:, :, None, None]  # [B, Hkv, 1, 1, P/G, D]
    qmax = (qs * s).flatten(2).amax(-1)  # [B, Hkv]: max |q*s| over rows, groups, channels
    return float(((qmax / QMAX) * cnorm / math.sqrt(12)).max())


def kernel_atol(q: torch.Tensor, layer: PackedKV, scale: float | None = None) -> float:
    """Absolute tolerance of the fused CPU kernel's output against the reference attention for q: [B, H, L, D]
    over ``layer`` (see the module docstring); pair it with ``rtol=FP32_RTOL``."""
    v = layer.dequantize(torch.float32)[1]
    vmax = float(v.abs().max()) if v.numel() else 0.0
    return FP32_ATOL + 2 * 3 * int16_logit_sigma(q, layer, scale) * vmax
