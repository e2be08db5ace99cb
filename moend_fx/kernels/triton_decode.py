"""Triton decode attention over packed K/V (flash-decoding with in-register dequantization).

One program = (batch row x KV head, token split, query block). It loads the query rows of the GQA group
(row m = query head ``m // L`` of the group, query ``m % L`` of the chunk), walks its share of the packed
tokens ``BLOCK_N`` at a time, unpacks and dequantizes K and V in registers, and keeps an online softmax
(running max ``m_i``, running sum ``l_i``, unnormalised ``acc``). The last split also walks the residual
window (whose V a quantized V holds packed: it is packed on arrival). Splits write (m_i, l_i, acc) partials,
which a second kernel merges by a log-sum-exp (:mod:`moend_fx.kernels.triton_merge`).

Specialised by ``tl.constexpr`` on K bits, V bits, head_dim, group size, block sizes and causal; the layer's
kept length picks the split count (:func:`choose_splits`).

On a CPU-only machine this module must be imported with ``TRITON_INTERPRET=1`` already set (``@triton.jit``
reads it when the kernel is decorated); :data:`INTERPRETED` records whether it was.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
import triton
import triton.language as tl

from moend_fx.common.errors import MoendError
from moend_fx.kernels.triton_merge import merge_splits


@triton.jit
def _load_rows(base, bkv, length, offs_n, offs_d, n_mask, HEAD_DIM: tl.constexpr):
    """Raw rows [BLOCK_N, HEAD_DIM] in fp32 of a [B*Hkv, length, HEAD_DIM] tensor (a residual window or a 16-bit
    packed side) at token offsets offs_n."""
    ptr = base + (bkv * length + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    return tl.load(ptr, mask=n_mask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load_codes(codes, bkv, P, offs_n, offs_d, n_mask, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Integer codes [BLOCK_N, HEAD_DIM] of the packed tokens offs_n: channel d is value d % PER of byte d // PER,
    at bit offset BITS * (d % PER)."""
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = HEAD_DIM // PER
    byte = tl.load(codes + (bkv * P + offs_n)[:, None] * W + (offs_d // PER)[None, :], mask=n_mask[:, None],
                   other=0)
    return (byte.to(tl.int32) >> ((offs_d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _dequantize(code, scale, zero, sidx, n_mask):
    """code * scale + zero in fp32, the fp16 scale and zero read at indices sidx [BLOCK_N, HEAD_DIM]."""
    sc = tl.load(scale + sidx, mask=n_mask[:, None], other=0.0).to(tl.float32)
    ze = tl.load(zero + sidx, mask=n_mask[:, None], other=0.0).to(tl.float32)
    return code.to(tl.float32) * sc + ze


@triton.jit
def _load_side(packed, scale, zero, res, bkv, offs_n, offs_d, n_mask, P, R, IN_RES: tl.constexpr,
               BITS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """K or V rows [BLOCK_N, HEAD_DIM] in fp32 for token offsets offs_n of the packed region or the residual.

    PER_CHANNEL: K's layout (groups of GROUP tokens per channel), else V's (groups of GROUP channels per token)."""
    if IN_RES:
        rows = _load_rows(res, bkv, R, offs_n, offs_d, n_mask, HEAD_DIM)
    elif BITS == 16:
        rows = _load_rows(packed, bkv, P, offs_n, offs_d, n_mask, HEAD_DIM)
    else:
        code = _load_codes(packed, bkv, P, offs_n, offs_d, n_mask, BITS, HEAD_DIM)
        if PER_CHANNEL:
            # scale/zero [.., P / GROUP, D]
            sidx = (bkv * (P // GROUP) + offs_n // GROUP)[:, None] * HEAD_DIM + offs_d[None, :]
        else:
            # scale/zero [.., P, D / GROUP]
            NG: tl.constexpr = HEAD_DIM // GROUP
            sidx = (bkv * P + offs_n)[:, None] * NG + (offs_d // GROUP)[None, :]
        rows = _dequantize(code, scale, zero, sidx, n_mask)
    return rows


@triton.jit
def _attend_block(q, m_i, l_i, acc, k, v, offs_tok, n_mask, limit, mask_ptr, mrow, HAS_MASK: tl.constexpr,
                  IEEE: tl.constexpr):
    """One online-softmax step over a block: q [BM, D] (pre-scaled), k/v [BN, D], token ids offs_tok [BN].

    HAS_MASK: the padding mask's byte at mrow [BM] (each row's offset, -1 past the group) + token id hides tokens.
    IEEE: fp32 dots (the reference's values); else Triton's default (TF32 tensor cores on a GPU, ~1e-3 relative)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, BN]
    else:
        s = tl.dot(q, tl.trans(k))
    visible = n_mask[None, :] & (offs_tok[None, :] <= limit[:, None])
    if HAS_MASK:
        allowed = tl.load(mask_ptr + mrow[:, None] + offs_tok[None, :], mask=visible & (mrow[:, None] >= 0), other=0)
        visible = visible & (allowed != 0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no visible key yet keep m = -inf; shift by 0 there to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_i, acc


@triton.jit
def _load_queries(q_ptr, b, kvh, offs_m, offs_d, H, L, S, scale, GQ: tl.constexpr, HEAD_DIM: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """Query rows offs_m of KV head kvh's GQA group, pre-scaled: [BLOCK_M, HEAD_DIM] fp32 (row m = query head m // L
    of the group, query m % L of the chunk; 0 past the group's GQ * L rows), and the last token id each row may see
    [BLOCK_M] (-1 past the group)."""
    m_mask = offs_m < GQ * L
    head = kvh * GQ + offs_m // L
    qpos = offs_m % L
    q = tl.load(q_ptr + ((b * H + head) * L + qpos)[:, None] * HEAD_DIM + offs_d[None, :], mask=m_mask[:, None],
                other=0.0).to(tl.float32) * scale
    # bottom-right causal mask: query qpos of the newest L tokens sees token ids <= S - L + qpos
    if CAUSAL:
        limit = S - L + qpos
    else:
        limit = qpos * 0 + S - 1
    return q, tl.where(m_mask, limit, -1)


@triton.jit
def _mask_rows(b, kvh, offs_m, L, GQ: tl.constexpr, msb, msh, msl):
    """Offset of each query row's padding-mask row [BLOCK_M] (-1 past the group's GQ * L rows): mask element
    (b, head, query, token) is at b * msb + head * msh + query * msl + token."""
    head = kvh * GQ + offs_m // L
    off = b.to(tl.int64) * msb + head.to(tl.int64) * msh + (offs_m % L).to(tl.int64) * msl  # may pass 2**31
    return tl.where(offs_m < GQ * L, off, -1)


@triton.jit
def _packed_decode_kernel(
    q_ptr, kp, ks, kz, vp, vs, vz, kr, vr, mask_ptr, part_m, part_l, part_acc,
    H, L, P, R, S, PV, tokens_per_split, num_splits, scale, msb, msh, msl,
    GQ: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GROUP_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, V_RES: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
):
    # PV: V's packed tokens, P (V split like K, V_RES) or S (V packed on arrival: no V residual)
    # mask_ptr: uint8 padding mask (element strides msb, msh, msl, 1; read only when HAS_MASK)
    tl.static_assert(HEAD_DIM % 8 == 0, "head_dim must be a multiple of 8")
    tl.static_assert(GROUP_V % 4 == 0, "the V group must hold whole bytes of 2-bit codes")
    tl.static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16 (tl.dot)")
    tl.static_assert(BLOCK_M >= 16, "BLOCK_M must be >= 16 (tl.dot)")
    bkv = tl.program_id(0)  # b * Hkv + kv head
    split = tl.program_id(1)
    mblk = tl.program_id(2)
    hkv = H // GQ
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, limit = _load_queries(q_ptr, bkv // hkv, bkv % hkv, offs_m, offs_d, H, L, S, scale, GQ, HEAD_DIM, CAUSAL)
    mrow = _mask_rows(bkv // hkv, bkv % hkv, offs_m, L, GQ, msb, msh, msl)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, P)
    for t0 in range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k = _load_side(kp, ks, kz, kr, bkv, offs_n, offs_d, n_mask, P, R, False, K_BITS, HEAD_DIM, GROUP, True)
        v = _load_side(vp, vs, vz, vr, bkv, offs_n, offs_d, n_mask, PV, R, False, V_BITS, HEAD_DIM, GROUP_V, False)
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k, v, offs_n, n_mask, limit, mask_ptr, mrow, HAS_MASK,
                                      IEEE)

    if split == num_splits - 1:
        for t0 in range(0, R, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < R
            k = _load_side(kp, ks, kz, kr, bkv, offs_n, offs_d, n_mask, P, R, True, K_BITS, HEAD_DIM, GROUP, True)
            if V_RES:
                v = _load_side(vp, vs, vz, vr, bkv, offs_n, offs_d, n_mask, PV, R, True, V_BITS, HEAD_DIM, GROUP_V,
                               False)
            else:  # the residual window's tokens P + offs_n of a V packed on arrival
                v = _load_side(vp, vs, vz, vr, bkv, P + offs_n, offs_d, n_mask, PV, R, False, V_BITS, HEAD_DIM,
                               GROUP_V, False)
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k, v, P + offs_n, n_mask, limit, mask_ptr, mrow,
                                          HAS_MASK, IEEE)

    # partials: [B*Hkv, splits, rows_padded] and [.., HEAD_DIM]
    n_mblk = tl.num_programs(2)
    row = (bkv * num_splits + split) * (n_mblk * BLOCK_M) + offs_m
    tl.store(part_m + row, m_i)
    tl.store(part_l + row, l_i)
    tl.store(part_acc + row[:, None] * HEAD_DIM + offs_d[None, :], acc)


# Whether @triton.jit gave interpreted kernels (TRITON_INTERPRET=1 was set when this module was imported).
INTERPRETED = not isinstance(_packed_decode_kernel, triton.runtime.jit.JITFunction)


def _interpret_env() -> contextlib.AbstractContextManager:
    """Keep TRITON_INTERPRET=1 set during an interpreted launch: Triton re-reads it lazily at launch time
    (its interpreter imports check the knob), not only when the kernel was decorated. Restored afterwards."""
    return mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}) if INTERPRETED else contextlib.nullcontext()


def choose_splits(tokens: int, units: int, block_n: int, device: torch.device) -> int:
    """Token splits for a kept length: enough programs to fill the GPU, each split >= 4 blocks long."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    max_splits = max(1, tokens // (4 * block_n))
    return max(1, min(max_splits, -(-target // max(1, units))))


def _mask_arg(mask: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The padding mask as the kernel reads it: uint8 bytes (a view of the bool tensor; tokens made contiguous) and
    the element strides of its batch, head (0 when broadcast over heads) and query dims; a stand-in when None."""
    if mask is None or mask.numel() == 0:  # no token to read (an empty tensor may have no valid pointer)
        return dummy, (0, 0, 0)
    if mask.shape[-1] > 1 and mask.stride(-1) != 1:
        mask = mask.contiguous()
    msh = 0 if mask.shape[1] == 1 else mask.stride(1)
    return mask.view(torch.uint8), (mask.stride(0), msh, mask.stride(2))


# Token block of a long layer (>= 4 blocks): on an H200 with TF32 dots (docs/results.md) 128 tokens a step ran
# 1.6-2.9x faster than 32 in 5 of 6 cases; at batch 1, 8k it was slower (0.29 vs 0.15 ms).
LONG_BLOCK_N = 128


def _launch_shape(p: int, units_per_block: int, rows: int, group_size: int, block_n: int | None,
                  block_m: int | None, num_splits: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(block_n, block_m, query blocks, splits, tokens per split) for P packed tokens and ``rows`` query rows per KV
    head (``units_per_block``: batch rows x KV heads)."""
    block_n = block_n or (LONG_BLOCK_N if p >= 4 * LONG_BLOCK_N else max(16, min(group_size, 64)))
    block_m = block_m or max(16, min(64, triton.next_power_of_2(rows)))
    n_mblk = -(-rows // block_m)
    ns = num_splits or choose_splits(p, units_per_block * n_mblk, block_n, device)
    per_split = -(-max(p, 1) // ns)
    per_split = -(-per_split // block_n) * block_n  # whole blocks, so splits start on a block boundary
    return block_n, block_m, n_mblk, max(1, -(-p // per_split)), per_split


def packed_attention_triton(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_packed: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_res: torch.Tensor,
    v_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int, scale: float, causal: bool,
    mask: torch.Tensor | None = None, num_splits: int = 0, block_n: int | None = None, block_m: int | None = None,
    precise: bool = False,
) -> torch.Tensor:
    """Launch the decode kernel. Shapes as in ``ops.packed_attention_op``; returns [B, H, L, D] in q's dtype.

    mask: bool [B, 1 or H, L, S] or None (read in place, as bytes); num_splits: token splits (0 =
    :func:`choose_splits`); block_n: tokens per step (default: 128 on a long layer, else G, at least 16);
    precise: fp32 dots (the reference's values: the tests); default Triton's, TF32 on a GPU (~1e-3 relative per
    logit, far below the 2-8-bit quantization error; exact under the interpreter).
    """
    if q.device.type != "cuda" and not INTERPRETED:
        raise MoendError(f"the Triton kernel needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set "
                         "before moend_fx.kernels.triton_decode is imported")
    b, h, l, d = q.shape
    hkv, r = k_res.shape[1], k_res.shape[2]
    p = k_packed.shape[2]
    gq = h // hkv
    if d & (d - 1) or d < 16:
        raise MoendError(f"the Triton kernel needs a power-of-two head_dim >= 16; got {d} (use kernel='reference')")
    rows = gq * l
    block_n, block_m, n_mblk, ns, per_split = _launch_shape(p, b * hkv, rows, group_size, block_n, block_m,
                                                            num_splits, q.device)
    part_m = torch.empty(b * hkv, ns, n_mblk * block_m, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(b * hkv, ns, n_mblk * block_m, d, device=q.device, dtype=torch.float32)
    dummy = torch.zeros(1, device=q.device, dtype=torch.float16)  # a valid pointer for empty tensors (raw sides)

    def ptr(t):
        return t.contiguous() if t.numel() else dummy

    mask_bytes, mstrides = _mask_arg(mask, dummy)

    with _interpret_env():
        _packed_decode_kernel[(b * hkv, ns, n_mblk)](
            q.contiguous(), ptr(k_packed), ptr(k_scale), ptr(k_zero), ptr(v_packed), ptr(v_scale), ptr(v_zero),
            ptr(k_res), ptr(v_res.to(k_res.dtype)), mask_bytes, part_m, part_l, part_acc,
            h, l, p, r, p + r, p + r - v_res.shape[2], per_split, ns, float(scale), *mstrides,
            GQ=gq, K_BITS=k_bits, V_BITS=v_bits, HEAD_DIM=d, GROUP=group_size, GROUP_V=min(group_size, d),
            BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal and l > 1), V_RES=bool(v_res.shape[2]),
            HAS_MASK=mask is not None, IEEE=bool(precise),
        )
        # rows of KV head bkv's group are (query head, query) in order: [B*Hkv, GQ*L, D] is [B, H, L, D]
        return merge_splits(part_m, part_l, part_acc, rows, block_m, q.dtype).view(b, h, l, d)
