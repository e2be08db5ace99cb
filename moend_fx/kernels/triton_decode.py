"""Triton decode attention over packed K/V, built around the bytes it reads (flash-decoding, one launch).

One program = (batch row x KV head, token split, query block). It holds the GQA group's query rows (row m = query
head ``m // L`` of the group, query ``m % L`` of the chunk; padded to 16, the smallest M of ``tl.dot``) and walks
its share of the packed tokens one K group (``GROUP`` tokens) at a time:

* K: the group's per-channel scale is folded into the query once (``q * s`` in fp16) and its zero point is one
  per-row bias (``q . z``), so the codes go to the tensor cores as they are (:func:`triton_blocks.k_logits`);
* codes become fp16 ``1024 + c`` by bit tricks, never by a per-code int-to-float conversion
  (:mod:`moend_fx.kernels.triton_unpack`; inline PTX on a GPU, plain Triton under the interpreter);
* V: per-token scale and zero applied in fp16 (one FMA per value), then ``p @ v`` with fp16 operands;
* fp16 dot operands, fp32 accumulation (``HMMA.16816.F32``); ``precise=True`` keeps fp32 operands and IEEE dots
  (the reference's values: the tests);
* the last split also walks the residual window (< G tokens; every token for a lossless layer);
* several splits merge inside the same launch: each program writes its (m, l, acc) partials, takes a ticket, and
  the last program of a (row, query block) merges them (:func:`triton_blocks.merge_splits`) and resets the ticket
  (so a replayed CUDA graph finds it at 0). One split writes the output directly.

Specialised by ``tl.constexpr`` on K bits, V bits, head_dim, group size, the V group, block sizes, causal, mask,
precision and whether inline asm is allowed; :func:`choose_splits` fills one wave of the GPU.

On a CPU-only machine this module must be imported with ``TRITON_INTERPRET=1`` already set (``@triton.jit`` reads
it when the kernel is decorated); :data:`INTERPRETED` records whether it was.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
import triton
import triton.language as tl

from moend_fx.common.errors import MoendError
from moend_fx.kernels.triton_blocks import merge_splits, packed_steps, residual_steps


@triton.jit
def _queries(q_ptr, b, kvh, offs_m, offs_d, H, L, S, scale, GQ: tl.constexpr, HEAD_DIM: tl.constexpr,
             CAUSAL: tl.constexpr):
    """Query rows offs_m of KV head kvh's group times scale (softmax scale x log2 e): [BM, D] fp32 (0 past the
    group's GQ * L rows), and the last token id each row may see [BM] (-1 past the group)."""
    m_mask = offs_m < GQ * L
    head = kvh * GQ + offs_m // L
    qpos = offs_m % L
    q = tl.load(q_ptr + ((b * H + head) * L + qpos)[:, None] * HEAD_DIM + offs_d[None, :], mask=m_mask[:, None],
                other=0.0).to(tl.float32) * scale
    if CAUSAL:  # bottom-right: query qpos of the newest L tokens sees token ids <= S - L + qpos
        limit = S - L + qpos
    else:
        limit = qpos * 0 + S - 1
    return q, tl.where(m_mask, limit, -1)


@triton.jit
def _decode_kernel(
    q_ptr, kp, ks, kz, vp, vs, vz, kr, vr, mask_ptr, out, part_m, part_l, part_acc, tickets,
    H, L, P, R, S, PV, tokens_per_split, num_splits, scale, msb, msh, msl,
    GQ: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    GROUP_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr,
    V_RES: tl.constexpr, HAS_MASK: tl.constexpr, PRECISE: tl.constexpr, USE_ASM: tl.constexpr, SPLIT: tl.constexpr,
):
    # kp/vp: int32 code words (or raw 16-bit rows); PV: V's packed tokens (P, or S when V is packed on arrival);
    # mask_ptr: uint8 padding mask (element strides msb, msh, msl, 1); tickets: int32 [B*Hkv * query blocks]
    tl.static_assert(BLOCK_N % GROUP == 0 and BLOCK_N >= 16, "BLOCK_N: whole K groups, >= 16 (the dot's N)")
    tl.static_assert(BLOCK_M >= 16, "BLOCK_M must be >= 16 (tl.dot)")
    bkv = tl.program_id(0)
    split = tl.program_id(1)
    mblk = tl.program_id(2)
    hkv = H // GQ
    b = bkv // hkv
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, limit = _queries(q_ptr, b, bkv % hkv, offs_m, offs_d, H, L, S, scale, GQ, HEAD_DIM, CAUSAL)
    q16 = q.to(tl.float16)
    head = (bkv % hkv) * GQ + offs_m // L
    mrow = b.to(tl.int64) * msb + head.to(tl.int64) * msh + (offs_m % L).to(tl.int64) * msl  # may pass 2**31
    mrow = tl.where(offs_m < GQ * L, mrow, -1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start = split * tokens_per_split
    p_main = P // BLOCK_N * BLOCK_N  # the splits' whole blocks; the last split takes the rest (whole K groups)
    m_i, l_i, acc = packed_steps(q, q16, m_i, l_i, acc, kp, ks, kz, vp, vs, vz, mask_ptr, mrow, limit, bkv, P, PV,
                                  start, tl.minimum(start + tokens_per_split, p_main), offs_d, K_BITS, V_BITS,
                                  HEAD_DIM, GROUP, GROUP_V, BLOCK_N, CAUSAL or HAS_MASK, HAS_MASK, PRECISE, USE_ASM)
    if split == num_splits - 1:  # packed tokens past the last whole block, then the residual window
        m_i, l_i, acc = packed_steps(q, q16, m_i, l_i, acc, kp, ks, kz, vp, vs, vz, mask_ptr, mrow, limit, bkv, P,
                                      PV, p_main, P, offs_d, K_BITS, V_BITS, HEAD_DIM, GROUP, GROUP_V, GROUP,
                                      CAUSAL or HAS_MASK, HAS_MASK, PRECISE, USE_ASM)
        m_i, l_i, acc = residual_steps(q, q16, m_i, l_i, acc, kr, vr, vp, vs, vz, mask_ptr, mrow, limit, bkv, P, R,
                                        PV, offs_d, V_BITS, HEAD_DIM, GROUP_V, BLOCK_R, V_RES, HAS_MASK, PRECISE,
                                        USE_ASM)
    # rows of KV head bkv's group are (query head, query) in order: out [B*Hkv, GQ*L, D] is [B, H, L, D]
    optr = out + (bkv * GQ * L + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    keep = (offs_m < GQ * L)[:, None]
    if SPLIT:
        n_mblk = tl.num_programs(2)
        base = (bkv * n_mblk + mblk) * num_splits * BLOCK_M  # partial rows [B*Hkv, mblk, splits, BLOCK_M]
        row = base + split * BLOCK_M + offs_m % BLOCK_M
        tl.store(part_m + row, m_i)
        tl.store(part_l + row, l_i)
        tl.store(part_acc + row[:, None] * HEAD_DIM + offs_d[None, :], acc)
        tl.debug_barrier()  # every thread's partials are written before the ticket is taken
        ticket = tl.atomic_add(tickets + bkv * n_mblk + mblk, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of this row block to finish merges them all
            res = merge_splits(part_m, part_l, part_acc, base, num_splits, offs_m % BLOCK_M, offs_d, BLOCK_M,
                               HEAD_DIM)
            tl.store(optr, res.to(out.dtype.element_ty), mask=keep)
            tl.atomic_xchg(tickets + bkv * n_mblk + mblk, 0)
    else:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(optr, res.to(out.dtype.element_ty), mask=keep)


# Whether @triton.jit gave interpreted kernels (TRITON_INTERPRET=1 was set when this module was imported).
INTERPRETED = not isinstance(_decode_kernel, triton.runtime.jit.JITFunction)
LOG2E = 1.4426950408889634
NUM_WARPS = 4
NUM_STAGES = 2


def max_registers(head_dim: int) -> int:
    """The register cap of the launch (``maxnreg``). Left to itself, ptxas held k8v4 at head_dim 64 to 128
    registers with a spill around the loop (static report, sm_90); a cap of 168 removed it (140 used) and moved no
    other head_dim <= 128 variant's main loop by more than 16 instructions; head_dim 256 needs ~233 (255: no cap)."""
    return 168 if head_dim <= 128 else 255
BLOCK_N = 128


def _interpret_env() -> contextlib.AbstractContextManager:
    """Keep TRITON_INTERPRET=1 set during an interpreted launch: Triton re-reads it lazily at launch time
    (its interpreter imports check the knob), not only when the kernel was decorated. Restored afterwards."""
    return mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}) if INTERPRETED else contextlib.nullcontext()


def resident_per_sm(head_dim: int) -> int:
    """Programs of this kernel one SM holds at once, from the static report (sm_90, 4 warps = 128 threads): up to
    head_dim 128 a program takes 127-168 registers a thread (16-22K of an SM's 64K: 3 fit) and 28-60 KB of shared
    memory; at head_dim 256, 116 KB of shared memory (of 228 KB): 1 fits."""
    return 3 if head_dim <= 128 else 1


def choose_splits(tokens: int, units: int, block_n: int, device: torch.device, per_sm: int = 3) -> int:
    """Token splits filling one wave: ``units`` programs per split (rows x KV heads x query blocks), ``per_sm``
    resident programs an SM (:func:`resident_per_sm`; 4 slots in all on a CPU), each split at least 4 blocks of
    ``block_n``. More splits than one wave only add merges; fewer leave SMs idle."""
    slots = torch.cuda.get_device_properties(device).multi_processor_count * per_sm if device.type == "cuda" else 4
    max_splits = max(1, tokens // (4 * block_n))
    return max(1, min(max_splits, slots // max(1, units)))


def constexprs(k_bits: int, v_bits: int, head_dim: int, group_size: int, gqa: int, block_m: int, block_n: int, *,
               causal: bool = False, v_res: bool = False, has_mask: bool = False, precise: bool = False,
               split: bool = False) -> dict:
    """The kernel's constexprs for a variant (the launch and the static report: moend_fx.kernels.static_report)."""
    return dict(GQ=gqa, K_BITS=k_bits, V_BITS=v_bits, HEAD_DIM=head_dim, GROUP=group_size,
                GROUP_V=min(group_size, head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_R=group_size if k_bits < 16 else 64,
                CAUSAL=causal, V_RES=v_res, HAS_MASK=has_mask, PRECISE=bool(precise), USE_ASM=not INTERPRETED,
                SPLIT=split)


def _mask_arg(mask: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The padding mask as the kernel reads it: uint8 bytes (a view of the bool tensor; tokens made contiguous) and
    the element strides of its batch, head (0 when broadcast over heads) and query dims; a stand-in when None."""
    if mask is None or mask.numel() == 0:  # no token to read (an empty tensor may have no valid pointer)
        return dummy, (0, 0, 0)
    if mask.shape[-1] > 1 and mask.stride(-1) != 1:
        mask = mask.contiguous()
    msh = 0 if mask.shape[1] == 1 else mask.stride(1)
    return mask.view(torch.uint8), (mask.stride(0), msh, mask.stride(2))


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of >= n split tickets on ``device``, kept between calls (the kernel leaves it at 0),
    so a call allocates nothing for them and a captured CUDA graph replays with the same buffer."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a capture it would live in the graph's private pool; the first (warm-up) call makes it
            raise MoendError(f"the Triton kernel needs {n} split tickets but its buffer was not made before this "
                             "CUDA graph capture; run the step once uncaptured first (warm-up)")
        buf = _TICKETS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def block_n_for(group_size: int) -> int:
    """Tokens a main-loop step: BLOCK_N (whole K groups; at least 16, the dot's N)."""
    return max(BLOCK_N, group_size)


def _launch_shape(p: int, units: int, rows: int, group_size: int, block_m: int | None, num_splits: int,
                  device: torch.device, head_dim: int = 64) -> tuple[int, int, int, int, int]:
    """(block_n, block_m, query blocks, splits, tokens per split) for P packed tokens and ``rows`` query rows per KV
    head (``units``: batch rows x KV heads); the splits share P's whole blocks (the last one also the rest)."""
    block_n = block_n_for(group_size)
    block_m = block_m or max(16, min(64, triton.next_power_of_2(rows)))
    n_mblk = -(-rows // block_m)
    blocks = p // block_n
    ns = num_splits or choose_splits(p, units * n_mblk, block_n, device, resident_per_sm(head_dim))
    per_split = -(-max(blocks, 1) // ns) * block_n
    return block_n, block_m, n_mblk, max(1, -(-blocks * block_n // per_split)), per_split


def _words(t: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes as int32 words (a view: a code row is D * bits / 8 bytes, a multiple of 4)."""
    return t.contiguous().view(torch.int32) if bits < 16 else t.contiguous()


def packed_attention_triton(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_packed: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_res: torch.Tensor,
    v_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int, scale: float, causal: bool,
    mask: torch.Tensor | None = None, num_splits: int = 0, block_m: int | None = None, precise: bool = False,
) -> torch.Tensor:
    """Launch the decode kernel. Shapes as in ``ops.packed_attention_op``; returns [B, H, L, D] in q's dtype.

    mask: bool [B, 1 or H, L, S] or None (read in place, as bytes); num_splits: token splits (0 =
    :func:`choose_splits`); precise: fp32 operands and IEEE dots (the reference's values: the tests); default fp16
    operands with fp32 accumulation (tolerances in tests/kernels/test_triton_decode.py).
    A group below 16 tokens (the dot's N) runs the reference instead.
    """
    if q.device.type != "cuda" and not INTERPRETED:
        raise MoendError(f"the Triton kernel needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set "
                         "before moend_fx.kernels.triton_decode is imported")
    b, h, l, d = q.shape
    if d & (d - 1) or d < 16:
        raise MoendError(f"the Triton kernel needs a power-of-two head_dim >= 16; got {d} (use kernel='reference')")
    if group_size < 16:  # the op's Triton implementation (kernels/ops.py) takes the reference for these
        raise MoendError(f"the Triton kernel needs group_size >= 16 (a dot's K); got {group_size} "
                         "(use kernel='reference')")
    hkv, r, p = k_res.shape[1], k_res.shape[2], k_packed.shape[2]
    rows = (h // hkv) * l
    block_n, block_m, n_mblk, ns, per_split = _launch_shape(p, b * hkv, rows, group_size, block_m, num_splits,
                                                            q.device, d)
    out = torch.empty(b, h, l, d, device=q.device, dtype=q.dtype)
    parts = b * hkv * n_mblk * ns * block_m if ns > 1 else 1
    part_m = torch.empty(parts, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(parts * d if ns > 1 else 1, device=q.device, dtype=torch.float32)
    dummy = torch.zeros(1, device=q.device, dtype=torch.int32)  # a valid pointer for empty tensors

    def ptr(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if t.numel() else dummy

    mask_bytes, mstrides = _mask_arg(mask, dummy)
    with _interpret_env():
        _decode_kernel[(b * hkv, ns, n_mblk)](
            q.contiguous(), ptr(_words(k_packed, k_bits)), ptr(k_scale), ptr(k_zero), ptr(_words(v_packed, v_bits)),
            ptr(v_scale), ptr(v_zero), ptr(k_res), ptr(v_res), mask_bytes, out, part_m, part_l, part_acc,
            _tickets(b * hkv * n_mblk, q.device), h, l, p, r, p + r, p + r - v_res.shape[2], per_split, ns,
            float(scale) * LOG2E, *mstrides, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
            maxnreg=max_registers(d),
            **constexprs(k_bits, v_bits, d, group_size, h // hkv, block_m, block_n, causal=bool(causal and l > 1),
                         v_res=bool(v_res.shape[2]), has_mask=mask is not None, precise=precise, split=ns > 1),
        )
    return out
