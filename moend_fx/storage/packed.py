"""One layer's compressed K/V storage: packed groups, a 16-bit residual window, original positions.

This is the data every consumer shares: the cache stores one :class:`PackedKV` per layer, the reference
attention and the fused kernels read its fields, and ``nbytes()`` is what the memory model predicts
(``moend_fx.plan.memory.layer_bytes``) to the byte. Layout: ``docs/cache-format.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.dtypes import POSITION_DTYPES, position_dtype, storage_dtype
from moend_fx.common.errors import MoendError
from moend_fx.common.options import QuantMode
from moend_fx.plan.memory import split_packed
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.quant import QuantizedTensor, dequantize, quantize
from moend_fx.storage.tokens import fill_pads, gather_tokens

Block = QuantizedTensor | torch.Tensor  # a raw tensor [B, H, P, D] (storage dtype) when that side is 16-bit


def _row_major_empty(x: torch.Tensor) -> torch.Tensor:
    """x itself, or for an empty x a new empty tensor whose strides are the plain row-major products of its sizes
    (PyTorch gives empty tensors max(size, 1) strides; a compiled graph expects the products, e.g. 0 for the
    batch and head strides of a layer with no packed group yet, and would otherwise recompile for it)."""
    if x.numel():
        return x
    strides, acc = [], 1
    for size in reversed(x.shape):
        strides.append(acc)
        acc *= size
    return x.new_empty_strided(tuple(x.shape), tuple(reversed(strides)))


def _encode(x: torch.Tensor, bits: int, group_size: int, mode: QuantMode) -> Block:
    """The block of x: [B, H, P, D] (P a multiple of group_size, already in the storage dtype): x itself when
    ``bits`` is 16, else its codes."""
    if bits == 16:
        return _row_major_empty(x.contiguous())
    return quantize(x, bits, group_size, mode).map(_row_major_empty)


def _decode(block: Block, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, P, D] values of a block in ``dtype``."""
    return block.to(dtype) if isinstance(block, torch.Tensor) else dequantize(block, dtype)


def _concat(a: Block, b: Block) -> Block:
    """Block a followed by block b (same kind) along the token axis."""
    return torch.cat([a, b], dim=2) if isinstance(a, torch.Tensor) else a.concat(b)


def _take(block: Block, tokens: torch.Tensor, groups: torch.Tensor) -> Block:
    """Whole groups ``groups`` [B, H, g] of a block, their tokens being ``tokens`` [B, H, g * G]."""
    kept = gather_tokens(block, tokens) if isinstance(block, torch.Tensor) else block.take(tokens, groups)
    return _map_block(kept, _row_major_empty)


def _map_block(block: Block, fn: Callable[[torch.Tensor], torch.Tensor]) -> Block:
    """The block with ``fn`` applied to each tensor it stores."""
    return fn(block) if isinstance(block, torch.Tensor) else block.map(fn)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A fresh copy of a residual window x: [B, H, R, D] (in the storage dtype), stored token-major (memory order
    [R, B, H, D]).

    Why: under torch.compile the decode graph is guarded on the strides of its inputs. Row-major strides of
    [B, H, R, D] depend on R and are irregular at R = 0 (PyTorch uses max(R, 1)), and a slice keeps the parent's
    storage offset (``.contiguous()`` is a no-op on a 0/1-token slice). Token-major strides (H*D, D, B*H*D, 1)
    never depend on R, so one graph serves every residual length.
    """
    # A new tensor with those strides, not a permuted clone: that is a view, and once the batch axis is symbolic
    # dynamo guards a view on its base, which an inductor graph's outputs lack (a recompile on the next step).
    b, h, r, d = x.shape
    return torch.empty_strided((b, h, r, d), (h * d, d, b * h * d, 1), dtype=x.dtype, device=x.device).copy_(x)


def slot_positions(start: Any, stop: Any, like: torch.Tensor) -> torch.Tensor:
    """Positions [B, H, stop - start] of the new slots ``start .. stop - 1`` of a layer whose K/V are ``like``
    [B, H, *, D], in the position type of ``stop`` slots (an expanded view: every row and head has the same)."""
    b, h = like.shape[:2]
    return torch.arange(start, stop, device=like.device, dtype=position_dtype(stop)).expand(b, h, stop - start)


def _stored_positions(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, H, n] (any integer type) in the narrowest position type holding them: ``position_dtype`` of
    the slots they need (largest + 1), contiguous.

    Reads the largest value (a host sync), so only eager code comes here (a prompt's compression, an eviction); a
    compiled decode step appends positions the cache layer already made in a position type."""
    slots = int(positions.max()) + 1 if positions.numel() else 0
    return positions.to(position_dtype(slots)).contiguous()


@dataclass(frozen=True)
class PackedKV:
    """Compressed K/V of one layer holding ``n = P + R`` tokens per (batch row, KV head).

    k_packed: K of the first P tokens (P a multiple of ``group_size``; 0 for a lossless layer), a
    :class:`QuantizedTensor` or, for 16-bit K, a raw tensor [B, H, P, D] in the storage dtype.
    v_packed: V likewise, of the first Pv tokens: a quantized V is packed as each token arrives (its groups are per
    token, so no token waits for a group; Pv = n), a 16-bit V follows K's split (Pv = P).
    k_res: [B, H, R, D] K of the last R tokens in the storage dtype; v_res: [B, H, n - Pv, D] likewise (no tokens
    when V is quantized).
    positions: [B, H, n] int16 (int32 past 32768 slots) original positions of the held tokens (ascending), or
    None when the layer never evicts (then token i is at position ``offset + i``; the cache tracks ``offset``).
    dtype: the model's dtype, in which K/V come in and :meth:`dequantize` gives them back. Raw K/V are stored in
    ``storage_dtype(dtype)`` (fp16, or bf16 for a bf16 model: 16 bits, as budgets count them), and every token
    is quantized from that 16-bit copy, so appending tokens one by one packs exactly what one call packs.
    """

    config: LayerConfig
    group_size: int
    k_packed: Block
    v_packed: Block
    k_res: torch.Tensor
    v_res: torch.Tensor
    positions: torch.Tensor | None
    dtype: torch.dtype

    @classmethod
    def from_dense(
        cls, k: torch.Tensor, v: torch.Tensor, config: LayerConfig, group_size: int = GROUP_SIZE,
        positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
    ) -> PackedKV:
        """Compress k, v: [B, H, n, D] in the model dtype (post-RoPE, already evicted). positions: [B, H, n] int.
        valid: [B, H, n] bool, False for padding (left padding, fillers of short rows): padding never enters a K
        group's min/max (:func:`~moend_fx.storage.tokens.fill_pads`; V groups are per token)."""
        if k.shape != v.shape or k.dim() != 4:
            raise MoendError(f"k and v must both be [B, H, n, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
        if config.evicts and positions is None:
            raise MoendError(f"layer config {config.name} evicts tokens, so positions [B, H, n] are required")
        p, _ = split_packed(k.shape[2], config, group_size)
        pv = k.shape[2] if config.v_bits < 16 else p
        pos = None
        if positions is not None:  # also a keep-1.0 layer that has started evicting (capacity mode)
            if positions.shape != k.shape[:3]:
                raise MoendError(f"positions must be [B, H, n] = {tuple(k.shape[:3])}; got {tuple(positions.shape)}")
            pos = _stored_positions(positions)
        # Quantized from the 16-bit copy too, as tokens that arrive through append are (see the class doc).
        raw = storage_dtype(k.dtype)
        ks, vs = k.to(raw), v.to(raw)
        if valid is not None and config.k_bits < 16 and not bool(valid.all()):
            ks = fill_pads(ks, valid, group_size)
        return cls(
            config, group_size,
            _encode(ks[:, :, :p], config.k_bits, group_size, QuantMode.CHANNEL),
            _encode(vs[:, :, :pv], config.v_bits, group_size, QuantMode.TOKEN),
            _fresh(ks[:, :, p:]), _fresh(vs[:, :, pv:]), pos, k.dtype,
        )

    @property
    def num_packed(self) -> int:
        return self.k_packed.shape[2] if isinstance(self.k_packed, torch.Tensor) else self.k_packed.num_tokens

    @property
    def v_on_arrival(self) -> bool:
        """Whether V is packed as each token arrives (a quantized V: v_res holds no token)."""
        return self.config.v_bits < 16

    @property
    def num_tokens(self) -> int:
        return self.num_packed + self.k_res.shape[2]

    @property
    def raw_dtype(self) -> torch.dtype:
        """What raw K/V (16-bit sides, the residual window) are stored in: ``storage_dtype(self.dtype)``."""
        return self.k_res.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V: [B, H, n, D] in ``dtype`` (default: the model's) of every held token (packed part dequantized, then
        the residual window)."""
        dtype = dtype or self.dtype
        k = torch.cat([_decode(self.k_packed, dtype), self.k_res.to(dtype)], dim=2)
        v = torch.cat([_decode(self.v_packed, dtype), self.v_res.to(dtype)], dim=2)
        return k, v

    def append(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None, *, keep_full: bool = False,
    ) -> PackedKV:
        """Add new tokens k, v: [B, H, L, D] (positions [B, H, L]) and flush full groups into packed codes.

        keep_full: leave the last full group in the residual window (it then holds 1..G tokens, not 0..G-1):
        the cache layer flushes it lazily, before the next append or from ``before_step`` outside a compiled
        decode step, so that step never has to branch on whether it fills a group. The packed codes are the
        same either way; only when the last group is quantized differs.
        """
        k_res = torch.cat([self.k_res, k.to(self.raw_dtype)], dim=2)
        if self.v_on_arrival:  # per-token groups: packing one token at a time packs what one call packs
            new_v = _encode(v.to(self.raw_dtype), self.config.v_bits, self.group_size, QuantMode.TOKEN)
            this, v_res = replace(self, v_packed=_concat(self.v_packed, new_v)), self.v_res
        else:
            this, v_res = self, torch.cat([self.v_res, v.to(self.raw_dtype)], dim=2)
        pos = self.positions
        if pos is not None:
            if positions is None:
                raise MoendError("this layer evicts, so appended tokens need their positions [B, H, L]")
            new = positions if positions.dtype in POSITION_DTYPES else _stored_positions(positions)
            # the wider of the two types: the context may just have outgrown int16
            wide = torch.promote_types(pos.dtype, new.dtype)
            pos = torch.cat([pos.to(wide), new.to(wide)], dim=2)
        r = k_res.shape[2]
        groups = (r - 1) // self.group_size if keep_full else r // self.group_size
        return this._flushed(k_res, v_res, pos, groups * self.group_size if self.config.quantized else 0)

    def flush(self) -> PackedKV:
        """Quantize every full group of the residual window into packed codes (self when there is none)."""
        r = self.k_res.shape[2]
        if not self.config.quantized or r < self.group_size:
            return self
        return self._flushed(self.k_res, self.v_res, self.positions, (r // self.group_size) * self.group_size)

    def _flushed(self, k_res: torch.Tensor, v_res: torch.Tensor, pos: torch.Tensor | None, flush: int) -> PackedKV:
        """This layer with residual k_res: [B, H, R, D] (v_res likewise, or empty when V is packed on arrival)
        whose first ``flush`` tokens (a multiple of G) are moved into packed codes."""
        if flush == 0:
            return replace(self, k_res=_fresh(k_res), v_res=_fresh(v_res), positions=pos)
        # Existing packed groups are kept bit for bit; only the new full groups are quantized.
        kp = _encode(k_res[:, :, :flush], self.config.k_bits, self.group_size, QuantMode.CHANNEL)
        vp, v_flush = self.v_packed, 0
        if not self.v_on_arrival:
            vp = _concat(vp, _encode(v_res[:, :, :flush], self.config.v_bits, self.group_size, QuantMode.TOKEN))
            v_flush = flush
        return replace(
            self, k_packed=_concat(self.k_packed, kp), v_packed=vp,
            k_res=_fresh(k_res[:, :, flush:]), v_res=_fresh(v_res[:, :, v_flush:]), positions=pos,
        )

    @property
    def num_groups(self) -> int:
        """Packed groups of ``group_size`` tokens."""
        return self.num_packed // self.group_size

    def keep_groups(self, groups: torch.Tensor) -> PackedKV:
        """This layer holding only the packed groups ``groups`` [B, H, g] int64 (ascending, the same count in every
        row and head) and the whole residual window. Kept codes, scales and zeros stay bit for bit: re-evicting
        whole groups never re-quantizes, so the kept tokens' error stays that of their first quantization."""
        g = self.group_size
        b, h, _ = groups.shape
        tokens = (groups[..., None] * g + torch.arange(g, device=groups.device)).reshape(b, h, -1)
        p, pos = self.num_packed, self.positions
        if pos is not None:
            pos = torch.cat([gather_tokens(pos[:, :, :p], tokens.to(pos.device)), pos[:, :, p:]], dim=2)
        v_tokens = tokens
        if self.v_on_arrival:  # V of the residual window's tokens is packed too, and kept
            res = torch.arange(p, self.num_tokens, device=tokens.device).expand(b, h, -1)
            v_tokens = torch.cat([tokens, res], dim=2)
        return replace(self, k_packed=_take(self.k_packed, tokens, groups),
                       v_packed=_take(self.v_packed, v_tokens, groups), positions=pos)

    def with_positions(self, positions: torch.Tensor) -> PackedKV:
        """This layer with stored positions [B, H, n] (a layer that kept every token and now starts evicting)."""
        if positions.shape != (*self.k_res.shape[:2], self.num_tokens):
            raise MoendError(f"positions {tuple(positions.shape)} must be [B, H, n] = "
                             f"{(*self.k_res.shape[:2], self.num_tokens)}")
        return replace(self, positions=_stored_positions(positions))

    def blocks(self) -> tuple[Block, Block]:
        """(k_packed, v_packed)."""
        return self.k_packed, self.v_packed

    def residuals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_res, v_res): [B, H, R, D] and [B, H, n - Pv, D] (no tokens when V is packed on arrival)."""
        return self.k_res, self.v_res

    def tensors(self, *, growing: bool = False) -> list[torch.Tensor]:
        """Every tensor this layer stores, token axis at dim 2 (codes, scales and zeros of a quantized side, a 16-bit
        side's raw tensor, the residuals, the positions); growing: not a V residual that stays empty (V on arrival)."""
        out: list[torch.Tensor] = []
        for block in self.blocks():
            out += [block] if isinstance(block, torch.Tensor) else list(block.tensors())
        out += [self.k_res] if growing and self.v_on_arrival else [self.k_res, self.v_res]
        if self.positions is not None:
            out.append(self.positions)
        return out

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedKV:
        """This layer with ``fn`` applied to every tensor it stores (a batch-axis or device operation: ``fn`` must
        keep the token axis, whose length differs between tensors)."""
        return replace(
            self, k_packed=_map_block(self.k_packed, fn), v_packed=_map_block(self.v_packed, fn),
            k_res=fn(self.k_res), v_res=fn(self.v_res),
            positions=None if self.positions is None else fn(self.positions),
        )

    def index_batch(self, index: torch.Tensor) -> PackedKV:
        """Batch rows ``index`` [B'] (beam search reorders, batch selection)."""
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def nbytes(self) -> int:
        """Bytes of every tensor this layer stores (equals ``memory.layer_bytes`` for the same n)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

