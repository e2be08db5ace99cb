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
    ``$0 .. $(P-1)``, output j = 1024 + code j."""
    per = 32 // bits
    half = per // 2
    mask = (1 << bits) - 1
    lines = ["{", ".reg .b32 t;"]
    for j in range(half):
        src = f"${per}"
        if j:
            lines.append(f"shr.b32 t, ${per}, {bits * j};")
            src = "t"
        lines.append(f"lop3.b32 t, {src}, {mask | mask << 16:#010x}, 0x64006400, 0xea;")  # (a & b) | c
        lines.append(f"mov.b32 {{${j}, ${j + half}}}, t;")
    return "\n".join(lines + ["}"])


# globals a @triton.jit function reads must be constexprs
ASM2 = tl.constexpr(unpack_asm(2))
ASM4 = tl.constexpr(unpack_asm(4))
ASM8 = tl.constexpr(unpack_asm(8))
OUT2 = tl.constexpr(",".join(["=h"] * 16 + ["r"]))
OUT4 = tl.constexpr(",".join(["=h"] * 8 + ["r"]))
OUT8 = tl.constexpr(",".join(["=h"] * 4 + ["r"]))


@triton.jit
def _join_tree4(h):
    """[.., 4] in code order from the 4 outputs of one word (pairs j, j + 2 first)."""
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
def unpack_fp16(w, ROWS: tl.constexpr, WORDS: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 code words [ROWS, WORDS] -> fp16 [ROWS, WORDS * 32 / BITS] holding 1024 + code, in channel order."""
    PER: tl.constexpr = 32 // BITS
    if USE_ASM:
        if BITS == 8:
            h = tl.inline_asm_elementwise(ASM8, OUT8, [w], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
            x = _join_tree4(h)
        elif BITS == 4:
            h = tl.inline_asm_elementwise(ASM4, OUT4, [w], dtype=(tl.float16,) * 8,
                                          is_pure=True, pack=1)
            x = _join_tree8(h)
        else:
            h = tl.inline_asm_elementwise(ASM2, OUT2, [w], dtype=(tl.float16,) * 16,
                                          is_pure=True, pack=1)
            x = _join_tree16(h)
        out = tl.reshape(x, [ROWS, WORDS * PER])
    else:
        shift = tl.arange(0, PER) * BITS
        code = (w[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)
        out = tl.reshape((code + 1024).to(tl.float16), [ROWS, WORDS * PER])
    return out
