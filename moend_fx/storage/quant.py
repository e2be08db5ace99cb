"""Bit-packed asymmetric min/max quantization of K and V (KIVI layout), as plain torch ops.

* K is quantized **per channel**: one (scale, zero) per group of ``G`` consecutive tokens and channel, since
  K's outliers live in fixed channels. Scales: ``[B, H, N // G, D]``.
* V is quantized **per token**: one (scale, zero) per token and group of ``G`` consecutive channels
  (``G`` capped at ``D``). Scales: ``[B, H, N, D // G]``.
* Codes are packed along head_dim into uint8: value ``j`` of a byte sits at bit offset ``bits * j``
  (4-bit: 2 per byte, 2-bit: 4 per byte). Layout details: ``docs/cache-format.md``.

``dequantize`` is also registered as the custom op ``torch.ops.moend.dequantize`` so that it is one node in
FX graphs (the ``moend`` backend fuses it into the attention kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from moend_fx.common.checks import check_choice, check_power_of_two
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.errors import MoendError
from moend_fx.common.options import QuantMode
from moend_fx.storage.tokens import gather_tokens

QUANT_BITS: tuple[int, ...] = (2, 4, 8)

OP_MODE: dict[QuantMode, int] = {QuantMode.CHANNEL: 0, QuantMode.TOKEN: 1}
"""The int each mode travels as in the ``moend::dequantize`` op (a custom op's schema has no enum type): the one
mapping between the two spellings. A plain ``"channel"`` / ``"token"`` string looks up the same entry."""


def check_quant_bits(bits: int) -> int:
    if bits not in QUANT_BITS:
        raise MoendError(f"bits={bits!r} cannot be packed; allowed: {list(QUANT_BITS)} (16 = stored as is)")
    return bits


def packed_width(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    per = 8 // check_quant_bits(bits)
    return (n + per - 1) // per


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes along the last axis into uint8.

    codes: [..., N] integer tensor with values in [0, 2**bits). Returns [..., ceil(N * bits / 8)] uint8;
    value j of byte i is ``codes[..., i * (8 // bits) + j]`` at bit offset ``bits * j``. A ragged tail is
    padded with zero codes.
    """
    per = 8 // check_quant_bits(bits)
    n = codes.shape[-1]
    width = packed_width(n, bits)
    c = codes.to(torch.uint8)
    if width * per != n:
        c = torch.nn.functional.pad(c, (0, width * per - n))
    c = c.reshape(*c.shape[:-1], width, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
    # Codes are < 2**bits, so the shifted fields never overlap: a sum is a bitwise or.
    return (c << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`. packed: [..., W] uint8 -> codes [..., n] uint8."""
    per = 8 // check_quant_bits(bits)
    if packed.dtype != torch.uint8:
        raise MoendError(f"packed codes must be uint8; got {packed.dtype}")
    if n > packed.shape[-1] * per or n < 0:
        raise MoendError(f"cannot unpack n={n} codes from {packed.shape[-1]} bytes of {bits}-bit codes")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :n]


@dataclass(frozen=True)
class QuantizedTensor:
    """Packed codes plus fp16 scales and zeros of a K or V block.

    codes: [B, H, N, ceil(D * bits / 8)] uint8; scale, zero: [B, H, N // G, D] (mode "channel") or
    [B, H, N, D // G] (mode "token"), float16. ``N`` is a multiple of ``G`` in mode "channel".
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    mode: QuantMode
    head_dim: int

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[-2]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, zero): every tensor this block stores, each with the token axis at dim 2."""
        return self.codes, self.scale, self.zero

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """This block with ``fn`` applied to codes, scale and zero (a batch-axis or device operation: ``fn`` must
        keep the token axis, whose length differs between codes and a "channel" block's scales)."""
        return replace(self, codes=fn(self.codes), scale=fn(self.scale), zero=fn(self.zero))

    def index_batch(self, index: torch.Tensor) -> QuantizedTensor:
        """Batch rows ``index`` [B'] of this block."""
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def concat(self, other: QuantizedTensor) -> QuantizedTensor:
        """This block followed by ``other`` (same bits, group size, mode and head_dim) along the token axis.

        Codes and scales both grow along dim 2 in either mode; the groups of each block are kept bit for bit."""
        return replace(self, codes=torch.cat([self.codes, other.codes], 2),
                       scale=torch.cat([self.scale, other.scale], 2), zero=torch.cat([self.zero, other.zero], 2))

    def take(self, tokens: torch.Tensor, groups: torch.Tensor) -> QuantizedTensor:
        """This block holding only the whole groups ``groups`` [B, H, g] (ascending), whose tokens are ``tokens``
        [B, H, g * G]: every kept code, scale and zero bit for bit (no re-quantization, so no drift). In mode
        "token" a token is its own group of scales, so ``tokens`` alone picks them."""
        sel = groups if self.mode == QuantMode.CHANNEL else tokens
        return replace(self, codes=gather_tokens(self.codes, tokens), scale=gather_tokens(self.scale, sel),
                       zero=gather_tokens(self.zero, sel))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def scale_shape(mode: QuantMode | str, batch: Any, heads: Any, tokens: Any, head_dim: int,
                group_size: int) -> tuple[Any, ...]:
    """Shape of the scales (and zeros) of a [batch, heads, tokens, head_dim] block quantized in ``mode``.

    Sizes may be SymInts (the graph passes check example values with it); ``head_dim`` must be an int."""
    if mode == QuantMode.CHANNEL:
        return batch, heads, tokens // group_size, head_dim
    return batch, heads, tokens, head_dim // min(group_size, head_dim)


def _group_view(x: torch.Tensor, group_size: int, mode: QuantMode) -> tuple[torch.Tensor, int]:
    """Reshape x [B, H, N, D] so that each quantization group is the last axis."""
    b, h, n, d = x.shape
    if mode == QuantMode.CHANNEL:
        if n % group_size:
            raise MoendError(f"per-channel (K) quantization needs a multiple of group_size={group_size} "
                             f"tokens; got {n} (keep the rest in the residual window)")
        # [B, H, N/G, G, D] -> groups along tokens: [B, H, N/G, D, G]
        return x.reshape(b, h, n // group_size, group_size, d).transpose(-1, -2), group_size
    g = min(group_size, d)
    if d % g:
        raise MoendError(f"head_dim={d} is not a multiple of the V group size {g}")
    return x.reshape(b, h, n, d // g, g), g


def quantize(x: torch.Tensor, bits: int, group_size: int = GROUP_SIZE,
             mode: QuantMode | str = QuantMode.CHANNEL) -> QuantizedTensor:
    """Asymmetric min/max quantization of x: [B, H, N, D] (float) to ``bits`` bits, packed.

    mode "channel" (for K) or "token" (for V); see the module docstring for the group layout.
    Scale and zero are rounded to fp16 *before* the codes are computed, so dequantization error stays
    within half a step of the stored scale (plus fp16 rounding of the zero).
    """
    check_quant_bits(bits)
    mode = check_choice("mode", mode, QuantMode, error=MoendError)
    if x.dim() != 4:
        raise MoendError(f"quantize expects [B, H, N, D]; got shape {tuple(x.shape)}")
    # A group size that changed between compiled calls arrives as a SymInt (automatic dynamic): no plain int to
    # check, and checking it would add a guard. The first value it took was a plain int, checked here.
    if not isinstance(group_size, torch.SymInt):
        check_power_of_two("group_size", group_size, error=MoendError)
    b, h, n, d = x.shape
    xg, _ = _group_view(x.float(), group_size, mode)
    mn, mx = torch.aminmax(xg, dim=-1, keepdim=True)
    qmax = (1 << bits) - 1
    zero16 = mn.to(torch.float16)
    zero = zero16.float()
    scale16 = ((mx - zero) / qmax).to(torch.float16)
    # Reading the check's value is a data-dependent branch: under torch.compile it would break the graph of
    # every decode step that flushes a group, so compiled code skips it (eager code still raises). The scales
    # alone tell: a non-finite or out-of-fp16-range min (the zero) makes its group's scale inf or nan too.
    if not torch.compiler.is_compiling() and not torch.isfinite(scale16).all():
        raise MoendError("cannot quantize: values are not finite or exceed the fp16 range of scales (65504)")
    scale = scale16.float()
    inv = scale.reciprocal().where(scale > 0, 0.0)
    codes = ((xg - zero) * inv).round_().clamp_(0, qmax).to(torch.uint8)
    if mode == QuantMode.CHANNEL:
        # back to token-major so each token's row packs along head_dim
        codes = codes.transpose(-1, -2)
    codes = codes.reshape(b, h, n, d)
    # scales, zeros: [B, H, N/G, D] (channel) or [B, H, N, D/G] (token), i.e. scale_shape(mode, ...)
    # A copy, not the squeezed view: a compiled decode graph guards on a view's base, and the block's scales
    # are views only until the first concat or take, so a view here cost a recompile at that layer's next flush.
    scale16, zero16 = scale16.squeeze(-1).clone(), zero16.squeeze(-1).clone()
    return QuantizedTensor(pack(codes, bits), scale16, zero16, bits, group_size, mode, d)


def dequantize_reference(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, mode: int,
    head_dim: int, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """codes: [B, H, N, W] uint8, scale/zero as in :class:`QuantizedTensor` -> values [B, H, N, D] in dtype.

    mode: the op's int for the group layout (:data:`OP_MODE`)."""
    c = unpack(codes, bits, head_dim).float()
    b, h, n, d = c.shape
    if mode == OP_MODE[QuantMode.CHANNEL]:
        s = scale.float().repeat_interleave(group_size, dim=-2)[..., :n, :]
        z = zero.float().repeat_interleave(group_size, dim=-2)[..., :n, :]
    else:
        g = min(group_size, d)
        s = scale.float().repeat_interleave(g, dim=-1)
        z = zero.float().repeat_interleave(g, dim=-1)
    return (c * s + z).to(dtype)


@torch.library.custom_op("moend::dequantize", mutates_args=())
def _dequantize_op(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int, mode: int,
    head_dim: int, dtype: torch.dtype,
) -> torch.Tensor:
    return dequantize_reference(codes, scale, zero, bits, group_size, mode, head_dim, dtype)


@_dequantize_op.register_fake
def _(codes, scale, zero, bits, group_size, mode, head_dim, dtype):
    return codes.new_empty((*codes.shape[:-1], head_dim), dtype=dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values [B, H, N, D] of a :class:`QuantizedTensor`, through the ``moend::dequantize`` op."""
    return torch.ops.moend.dequantize(*q.tensors(), q.bits, q.group_size, OP_MODE[q.mode], q.head_dim, dtype)
