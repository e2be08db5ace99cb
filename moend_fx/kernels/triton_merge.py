"""The Triton kernel that merges the token splits of :mod:`moend_fx.kernels.triton_decode` into the output.

Each split left, for every query row, its running max ``m``, sum ``l`` and unnormalised ``acc``; the output row is
``sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s`` (0 where no split saw a visible token). One launch instead of
a dozen torch ops: on an H200 the torch merge cost more host time per call than the decode kernel ran.

Imported by :mod:`moend_fx.kernels.triton_decode`, which launches it (under the same interpreter setting).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_splits_kernel(part_m, part_l, part_acc, out, num_splits, rows, rows_padded, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    # part_m, part_l: [B*Hkv, splits, rows_padded]; part_acc: [.., HEAD_DIM]; out: [B*Hkv, rows, HEAD_DIM]
    bkv = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(0, num_splits):
        row = (bkv * num_splits + s) * rows_padded + offs_m
        m_s = tl.load(part_m + row)
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible token yet: avoid inf - inf
        alpha = tl.exp(m_run - m_safe)
        beta = tl.exp(m_s - m_safe)
        l_run = l_run * alpha + tl.load(part_l + row) * beta
        acc = acc * alpha[:, None] + tl.load(part_acc + row[:, None] * HEAD_DIM + offs_d[None, :]) * beta[:, None]
        m_run = m_new
    res = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    keep = offs_m < rows
    tl.store(out + (bkv * rows + offs_m)[:, None] * HEAD_DIM + offs_d[None, :],
             res.to(out.dtype.element_ty), mask=keep[:, None])


def merge_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor, rows: int,
                 block_m: int, dtype: torch.dtype) -> torch.Tensor:
    """[B*Hkv, rows, D] in ``dtype`` from the partials part_m, part_l: [B*Hkv, splits, rows_padded] fp32 and
    part_acc: [B*Hkv, splits, rows_padded, D] fp32 (rows_padded a multiple of block_m)."""
    bkv, ns, rows_padded, d = part_acc.shape
    out = torch.empty(bkv, rows, d, device=part_acc.device, dtype=dtype)
    _merge_splits_kernel[(bkv, rows_padded // block_m)](part_m, part_l, part_acc, out, ns, rows, rows_padded,
                                                         HEAD_DIM=d, BLOCK_M=block_m)
    return out
