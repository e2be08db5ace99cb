"""Per-block pieces of the Triton decode kernel (:mod:`moend_fx.kernels.triton_decode`): the K logits, the V
operand, one online-softmax step, and the in-launch merge of token splits.

All ``@triton.jit`` helpers, inlined into the kernel; the decode module is the only importer. Shapes in the
docstrings: ``BM`` query rows (the GQA group's, padded to the dot's smallest M, 16), ``BN`` tokens, ``D`` head_dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moend_fx.kernels.triton_unpack import unpack_fp16


@triton.jit
def k_logits(q, q16, kp, ks, kz, bkv, P, t0, offs_n, offs_d, K_BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
             GROUP: tl.constexpr, BN: tl.constexpr, PRECISE: tl.constexpr, USE_ASM: tl.constexpr):
    """Base-2 logits [BM, BN] of the packed K tokens offs_n = t0 + [0, BN) (whole K groups: t0 and BN are
    multiples of GROUP, so no load is masked). q: [BM, D] fp32 scaled by the softmax scale x log2 e; q16 its fp16.

    Quantized K: codes come as exact fp16 values without a per-code int-to-float conversion
    (:mod:`moend_fx.kernels.triton_unpack`); each group's per-channel scale and zero rows ([BN / GROUP, D], one
    load each, broadcast over the group's tokens) are applied by one fp16 FMA per value; then q16 @ k^T with fp32
    accumulation. (Folding the scale into q instead, q*s per group and a per-row bias for the zero point,
    measured 0.45 warp-instructions per byte against this path's 0.36 at 4 warps and 32-token steps: with the 3
    query rows padded to the dot's 16, scaling q costs as much as scaling the codes, and the bias adds a
    cross-lane sum per group; docs/kernels.md.)
    PRECISE: fp32 operands and IEEE dots (the reference's values, for the tests)."""
    if K_BITS == 16:
        k = tl.load(kp + (bkv * P + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
    else:
        NW: tl.constexpr = HEAD_DIM * K_BITS // 32
        NG: tl.constexpr = BN // GROUP
        w = tl.load(kp + (bkv * P + offs_n)[:, None] * NW + tl.arange(0, NW)[None, :])
        c = unpack_fp16(w, BN, NW, K_BITS, USE_ASM)  # [BN, D] fp16 codes, exact
        grp = ((bkv * (P // GROUP) + t0 // GROUP + tl.arange(0, NG)) * HEAD_DIM)[:, None] + offs_d[None, :]
        sc = tl.reshape(tl.broadcast_to(tl.load(ks + grp)[:, None, :], [NG, GROUP, HEAD_DIM]), [BN, HEAD_DIM])
        ze = tl.reshape(tl.broadcast_to(tl.load(kz + grp)[:, None, :], [NG, GROUP, HEAD_DIM]), [BN, HEAD_DIM])
        if PRECISE:
            k = c.to(tl.float32) * sc.to(tl.float32) + ze.to(tl.float32)
        else:
            k = c * sc + ze  # one fp16 FMA (2^-11 of |k|)
    if PRECISE:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q16, tl.trans(k.to(tl.float16)))
    return s


@triton.jit
def v_rows(vp, vs, vz, bkv, PV, offs_n, offs_d, n_mask, V_BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
           GROUP_V: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr, PRECISE: tl.constexpr,
           USE_ASM: tl.constexpr):
    """V rows [BN, D] of tokens offs_n (fp16; fp32 when PRECISE) from the packed V (codes, per-token scale and zero
    over GROUP_V channels) or a raw 16-bit V. EVEN: every token is in range (no masks on the loads)."""
    if V_BITS == 16:
        ptr = vp + (bkv * PV + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
        v = tl.load(ptr) if EVEN else tl.load(ptr, mask=n_mask[:, None], other=0.0)
        v = v.to(tl.float32) if PRECISE else v.to(tl.float16)
    else:
        NW: tl.constexpr = HEAD_DIM * V_BITS // 32
        NGV: tl.constexpr = HEAD_DIM // GROUP_V
        wptr = vp + (bkv * PV + offs_n)[:, None] * NW + tl.arange(0, NW)[None, :]
        sidx = (bkv * PV + offs_n)[:, None] * NGV + tl.arange(0, NGV)[None, :]
        if EVEN:
            w = tl.load(wptr)
            sc = tl.load(vs + sidx)
            ze = tl.load(vz + sidx)
        else:
            w = tl.load(wptr, mask=n_mask[:, None], other=0)
            sc = tl.load(vs + sidx, mask=n_mask[:, None], other=0.0)
            ze = tl.load(vz + sidx, mask=n_mask[:, None], other=0.0)
        c = unpack_fp16(w, BN, NW, V_BITS, USE_ASM)  # [BN, D] fp16 codes, exact
        scb = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, NGV, GROUP_V]), [BN, HEAD_DIM])
        zeb = tl.reshape(tl.broadcast_to(ze[:, :, None], [BN, NGV, GROUP_V]), [BN, HEAD_DIM])
        if PRECISE:
            v = c.to(tl.float32) * scb.to(tl.float32) + zeb.to(tl.float32)
        else:
            v = c * scb + zeb  # one fp16 FMA per value (2^-11 of |v|, well under a 2-8-bit step)
    return v


@triton.jit
def softmax_step(s, m_i, l_i, visible, MASKED: tl.constexpr):
    """One online-softmax step over base-2 logits s [BM, BN]: (m_new, l_new, alpha [BM], p [BM, BN]).
    MASKED: hide the tokens where visible [BM, BN] is False (else every token is seen)."""
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no visible key yet keep m = -inf; shift by 0 there to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def pv(acc, alpha, p, v, PRECISE: tl.constexpr):
    """acc [BM, D] rescaled by alpha [BM] plus p [BM, BN] @ v [BN, D] (fp16 operands, fp32 accumulation)."""
    if PRECISE:
        return acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(tl.float16), v, acc * alpha[:, None])


@triton.jit
def merge_splits(part_m, part_l, part_acc, base, num_splits, offs_m, offs_d, BM: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """Normalised output rows [BM, D] from the partials (m, l, acc) of every split: part_m/part_l rows
    base + s * BM + offs_m, part_acc the same rows x D. Rows no split saw a token in give 0."""
    m_run = tl.full([BM], float("-inf"), tl.float32)
    l_run = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_DIM], tl.float32)
    for s in range(0, num_splits):
        row = base + s * BM + offs_m
        m_s = tl.load(part_m + row, cache_modifier=".cg")  # written by other programs in this launch: skip L1
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_safe)
        beta = tl.math.exp2(m_s - m_safe)
        l_run = l_run * alpha + tl.load(part_l + row, cache_modifier=".cg") * beta
        a_s = tl.load(part_acc + row[:, None] * HEAD_DIM + offs_d[None, :], cache_modifier=".cg")
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_run = m_new
    return acc / tl.where(l_run > 0, l_run, 1.0)[:, None]


@triton.jit
def visible(offs_tok, n_mask, limit, mask_ptr, mrow, HAS_MASK: tl.constexpr):
    """[BM, BN]: token offs_tok [BN] in range (n_mask), within each row's causal limit [BM], and allowed by the
    padding mask's byte at row offset mrow [BM] (-1 past the group) when HAS_MASK."""
    visible = n_mask[None, :] & (offs_tok[None, :] <= limit[:, None])
    if HAS_MASK:
        allowed = tl.load(mask_ptr + mrow[:, None] + offs_tok[None, :], mask=visible & (mrow[:, None] >= 0),
                          other=0)
        visible = visible & (allowed != 0)
    return visible


@triton.jit
def packed_steps(q, q16, m_i, l_i, acc, kp, ks, kz, vp, vs, vz, mask_ptr, mrow, limit, bkv, P, PV, lo, hi, offs_d,
                 K_BITS: tl.constexpr, V_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                 GROUP_V: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, HAS_MASK: tl.constexpr,
                 PRECISE: tl.constexpr, USE_ASM: tl.constexpr):
    """Online softmax over packed tokens [lo, hi) in steps of BN (whole K groups: no load is masked); returns the
    updated (m_i [BM], l_i [BM], acc [BM, D])."""
    offs = tl.arange(0, BN)
    for t0 in tl.range(lo, hi, BN):
        s = k_logits(q, q16, kp, ks, kz, bkv, P, t0, t0 + offs, offs_d, K_BITS, HEAD_DIM, GROUP, BN, PRECISE, USE_ASM)
        v = v_rows(vp, vs, vz, bkv, PV, t0 + offs, offs_d, offs >= 0, V_BITS, HEAD_DIM, GROUP_V, BN, True, PRECISE,
                   USE_ASM)
        vis = visible(t0 + offs, offs >= 0, limit, mask_ptr, mrow, HAS_MASK)
        m_i, l_i, alpha, p = softmax_step(s, m_i, l_i, vis, MASKED)
        acc = pv(acc, alpha, p, v, PRECISE)
    return m_i, l_i, acc


@triton.jit
def residual_steps(q, q16, m_i, l_i, acc, kr, vr, vp, vs, vz, mask_ptr, mrow, limit, bkv, P, R, PV, offs_d,
                    V_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_V: tl.constexpr, BR: tl.constexpr,
                    V_RES: tl.constexpr, HAS_MASK: tl.constexpr, PRECISE: tl.constexpr, USE_ASM: tl.constexpr):
    """Online softmax over the residual window's R tokens (ids P + [0, R)): raw K, and raw V (V_RES) or V packed
    on arrival (tokens P + [0, R) of the packed V); returns the updated (m_i, l_i, acc)."""
    offs_r = tl.arange(0, BR)
    for t0 in range(0, R, BR):
        n_mask = t0 + offs_r < R
        k = tl.load(kr + (bkv * R + t0 + offs_r)[:, None] * HEAD_DIM + offs_d[None, :], mask=n_mask[:, None],
                    other=0.0)
        if PRECISE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q16, tl.trans(k.to(tl.float16)))
        if V_RES:
            v = v_rows(vr, vs, vz, bkv, R, t0 + offs_r, offs_d, n_mask, 16, HEAD_DIM, GROUP_V, BR, False, PRECISE,
                       USE_ASM)
        else:
            v = v_rows(vp, vs, vz, bkv, PV, P + t0 + offs_r, offs_d, n_mask, V_BITS, HEAD_DIM, GROUP_V, BR, False,
                       PRECISE, USE_ASM)
        vis = visible(P + t0 + offs_r, n_mask, limit, mask_ptr, mrow, HAS_MASK)
        m_i, l_i, alpha, p = softmax_step(s, m_i, l_i, vis, True)
        acc = pv(acc, alpha, p, v, PRECISE)
    return m_i, l_i, acc
