"""Packed codes to fp16 tensor-core operands without an int-to-float conversion per code.

A code ``c < 2**10`` written into the mantissa of fp16 ``1024.0`` (bits ``0x6400 | c``) is the fp16 number
``1024 + c``, exactly. So a 32-bit word of codes (``32 / BITS`` of them, code ``j`` at bit ``BITS * j``, channel
``word * 32 / BITS + j``: the cache's order, docs/cache-format.md) becomes fp16 operands by a shift and one
``lop3`` (``(w >> BITS*j) & mask | 0x64006400``) per two codes: codes ``j`` and ``j + 16 / BITS`` land in the low
and high halves of one 32-bit register, which is how an fp16 pair sits in a tensor-core operand register. The
kernel folds the ``1024`` offset into its zero-point terms (:mod:`moend_fx.kernels.triton_decode`).

On a GPU this is PTX through ``tl.inline_asm_elementwise``; under ``TRITON_INTERPRET=1`` (which cannot run inline
asm) the same values come from plain Triton (shift, mask, add 1024, convert): the same numbers, so the interpreter
tests check the kernel's arithmetic around them.
"""

from __future__ import annotations

import triton
import triton.language as tl


def unpack_asm(bits: int) -> str:
    """PTX turning the word ``$P`` (P = 32 / bits, the input's operand number) into ``32 / bits`` fp16 outputs
    ``$0 .. $(P-1)``, output j = 1024 + code j * 2**(bits * (j % (8 / bits))) (:func:`exponents`).

    Per pair of adjacent channels (2i, 2i+1), which share a byte below 8 bits: one ``prmt`` copies their byte(s)
    into both 16-bit halves with 0x64 above (8 bits: bytes 2i and 2i+1, done), one ``lop3`` keeps each half's
    field (4 bits: the byte's low nibble in the low half, its high nibble, in place, in the high half; 2 bits: two
    pairs from one ``prmt``). The fields are then ``code * 2**e`` above 1024, which :func:`unpack_fp16` undoes."""
    per = 32 // bits
    lines = ["{", ".reg .b32 t;"]
    for i in range(per // 2):
        byte = 2 * i * bits // 8  # the byte holding channel 2i
        if bits == 8:
            lines.append(f"prmt.b32 ${2 * i}x, ${per}, 0x64646464, {byte | 4 << 4 | (byte + 1) << 8 | 4 << 12:#06x};")
            continue
        if (2 * i * bits) % 8 == 0:  # a new byte: both halves get it, 0x64 above
            lines.append(f"prmt.b32 t, ${per}, 0x64646464, {byte | 4 << 4 | byte << 8 | 4 << 12:#06x};")
        lo = ((1 << bits) - 1) << ((2 * i * bits) % 8)
        hi = lo << bits
        lines.append(f"lop3.b32 ${2 * i}x, t, {0xFF00FF00 | hi << 16 | lo:#010x}, 0, 0xc0;")  # a & b
    body = "\n".join(lines + ["}"])
    # each pair register is split into its two fp16 outputs
    for i in range(per // 2):
        body = body.replace(f"${2 * i}x", f"p{i}")
    regs = ", ".join(f"p{i}" for i in range(per // 2))
    movs = "\n".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};" for i in range(per // 2))
    return body.replace(".reg .b32 t;", f".reg .b32 t, {regs};").rstrip("}") + movs + "\n}"


def exponents(bits: int) -> list[int]:
    """e per channel j of a word: the unpacked fp16 is 1024 + code * 2**e, e = bits * (j % (8 / bits))."""
    return [bits * (j % (8 // bits)) for j in range(32 // bits)]


# globals a @triton.jit function reads must be constexprs
ASM2 = tl.constexpr(unpack_asm(2))
ASM4 = tl.constexpr(unpack_asm(4))
ASM8 = tl.constexpr(unpack_asm(8))
OUT2 = tl.constexpr(",".join(["=h"] * 16 + ["r"]))
OUT4 = tl.constexpr(",".join(["=h"] * 8 + ["r"]))
OUT8 = tl.constexpr(",".join(["=h"] * 4 + ["r"]))


@triton.jit
def _join_tree4(h):
    """[.., 4] in channel order from the 4 outputs of one word (the last join is the innermost, adjacent pair)."""
    return tl.join(tl.join(h[0], h[2]), tl.join(h[1], h[3]))


@triton.jit
def _join_tree8(h):
    y0 = tl.join(h[0], h[4])
    y1 = tl.join(h[1], h[5])
    y2 = tl.join(h[2], h[6])
    y3 = tl.join(h[3], h[7])
    return tl.join(tl.join(y0, y2), tl.join(y1, y3))


@triton.jit
def _join_tree16(h):
    y0 = tl.join(h[0], h[8])
    y1 = tl.join(h[1], h[9])
    y2 = tl.join(h[2], h[10])
    y3 = tl.join(h[3], h[11])
    y4 = tl.join(h[4], h[12])
    y5 = tl.join(h[5], h[13])
    y6 = tl.join(h[6], h[14])
    y7 = tl.join(h[7], h[15])
    z0 = tl.join(y0, y4)
    z1 = tl.join(y1, y5)
    z2 = tl.join(y2, y6)
    z3 = tl.join(y3, y7)
    return tl.join(tl.join(z0, z2), tl.join(z1, z3))


@triton.jit
def _field(w, j: tl.constexpr, BITS: tl.constexpr):
    """Plain Triton for the asm's output j: fp16 1024 + code j * 2**e_j (the interpreter cannot run inline asm)."""
    E: tl.constexpr = (j % (8 // BITS)) * BITS
    return ((((w >> (j * BITS)) & ((1 << BITS) - 1)) << E) + 1024).to(tl.float16)


@triton.jit
def _fields(w, ROWS: tl.constexpr, WORDS: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """fp16 [ROWS, WORDS * 32 / BITS]: 1024 + code * 2**e per channel (:func:`exponents`). The outputs of a word
    go through the same join tree on both paths, so the interpreter tests check its channel order too."""
    PER: tl.constexpr = 32 // BITS
    if BITS == 8:
        if USE_ASM:
            h = tl.inline_asm_elementwise(ASM8, OUT8, [w], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
        else:
            h = (_field(w, 0, 8), _field(w, 1, 8), _field(w, 2, 8), _field(w, 3, 8))
        x = _join_tree4(h)
    elif BITS == 4:
        if USE_ASM:
            h = tl.inline_asm_elementwise(ASM4, OUT4, [w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            h = (_field(w, 0, 4), _field(w, 1, 4), _field(w, 2, 4), _field(w, 3, 4), _field(w, 4, 4),
                 _field(w, 5, 4), _field(w, 6, 4), _field(w, 7, 4))
        x = _join_tree8(h)
    else:
        if USE_ASM:
            h = tl.inline_asm_elementwise(ASM2, OUT2, [w], dtype=(tl.float16,) * 16, is_pure=True, pack=1)
        else:
            h = (_field(w, 0, 2), _field(w, 1, 2), _field(w, 2, 2), _field(w, 3, 2), _field(w, 4, 2),
                 _field(w, 5, 2), _field(w, 6, 2), _field(w, 7, 2), _field(w, 8, 2), _field(w, 9, 2),
                 _field(w, 10, 2), _field(w, 11, 2), _field(w, 12, 2), _field(w, 13, 2), _field(w, 14, 2),
                 _field(w, 15, 2))
        x = _join_tree16(h)
    return tl.reshape(x, [ROWS, WORDS * PER])


@triton.jit
def unpack_fp16(w, ROWS: tl.constexpr, WORDS: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 code words [ROWS, WORDS] -> the codes as fp16 [ROWS, WORDS * 32 / BITS], exactly, in channel order:
    the fields 1024 + c * 2**e (no int-to-float conversion) times 2**-e plus -1024 * 2**-e, one fp16 FMA a value,
    exact (a power-of-two scaling of integers below 2**11)."""
    PER: tl.constexpr = 32 // BITS
    x = _fields(w, ROWS, WORDS, BITS, USE_ASM)
    e = (tl.arange(0, WORDS * PER) % (8 // BITS)) * BITS
    f = tl.exp2(-e.to(tl.float32))
    return x * f.to(tl.float16)[None, :] + (-1024.0 * f).to(tl.float16)[None, :]
