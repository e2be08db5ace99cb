"""The window of recent queries a query-reading scorer scores with: part of what a cache layer stores, so it is
kept small (16-bit, its own storage) and counted (:meth:`QueryWindow.nbytes`, :meth:`QueryWindow.bytes_for`)."""

from __future__ import annotations

import torch

from moend_fx.common.dtypes import storage_dtype

_POSITION_DTYPE = torch.int32  # slots and RoPE positions: a context never reaches 2**31 tokens


class QueryWindow:
    """The last ``size`` post-RoPE queries a layer saw, with their logical slots and RoPE positions.

    queries: [B, H, W, D] in the layer's 16-bit storage type (``moend_fx.common.dtypes.storage_dtype``: the
    scorers rank keys with them, and fp16 keeps far more precision than a ranking needs); slots: [W] int32
    (columns of HF's logical mask); positions: [B, W] int32 (what RoPE rotated them by: slot - the row's
    left-padding offset). W <= size; all None until the first :meth:`push`. Each is a fresh tensor (never a view
    into the prompt's queries, which would keep the whole prompt's query tensor alive).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.dtype: torch.dtype | None = None  # the queries' own dtype, handed back by select
        self.queries: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.held: torch.Tensor | None = None  # a compiled decode step's query [B, H, 1, D], not yet pushed

    def hold(self, query: torch.Tensor) -> None:
        """Keep a compiled decode step's query [B, H, 1, D] for :meth:`push_held`, which runs outside the graph.

        Why: a window still filling (a keep-1.0 layer that started evicting mid-decode) grows by one query a
        step, and a graph that pushed would be guarded on its length: recompiled when it leaves size 1 and
        again when it fills. The held query is the step's transient, like its mask: not counted in the bytes."""
        self.held = query

    def push_held(self, slot: int, rope_offset: torch.Tensor) -> None:
        """Push the held query (if any) at logical ``slot``, its rows' RoPE offsets rope_offset [B]."""
        if self.held is not None:
            q, self.held = self.held, None
            slots = torch.tensor([slot], device=q.device)
            self.push(q, slots, slots[None, :] - rope_offset[:, None])

    @staticmethod
    def bytes_for(*, batch: int, num_heads: int, head_dim: int, seen: int, size: int) -> int:
        """Bytes a window of ``size`` holds after ``seen`` queries (queries, slots, positions)."""
        w = min(seen, size)
        return batch * num_heads * w * head_dim * 2 + w * 4 + batch * w * 4

    def push(self, queries: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Add the newest queries [B, H, L, D] at slots [L] and RoPE positions [B, L]; keep the last ``size``."""
        w = self.size
        self.dtype = queries.dtype
        # copy=True: a slice, or a cast that changes nothing, would share (and keep alive) the storage of
        # everything it came from, e.g. the whole prompt's queries after a prefill
        q = queries[:, :, -w:].detach().to(storage_dtype(queries.dtype), copy=True)
        slots = slots[-w:].to(_POSITION_DTYPE, copy=True)
        positions = positions[:, -w:].to(_POSITION_DTYPE, copy=True)
        old = 0 if self.queries is None else min(w - q.shape[2], self.queries.shape[2])
        if old > 0:  # the newest ``old`` of the window stay; cat of exact slices leaves no slack storage
            q = torch.cat([self.queries[:, :, -old:], q], dim=2)
            slots = torch.cat([self.slots[-old:], slots])
            positions = torch.cat([self.positions[:, -old:], positions], dim=1)
        self.queries, self.slots, self.positions = q, slots, positions

    def select(self, row: int | None = None, keep: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(queries [b, H, w, D] in their own dtype, positions [b, w] int64) of batch row ``row`` (b = 1; None =
        every row), only the window queries ``keep`` [W] bool marks (None = all); (None, None) before the first
        push."""
        if self.queries is None:
            return None, None
        q, pos = self.queries, self.positions
        if row is not None:
            q, pos = q[row : row + 1], pos[row : row + 1]
        if keep is not None:
            q, pos = q[:, :, keep], pos[:, keep]
        return q.to(self.dtype), pos.long()

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` [B'] (beam search, batch selection)."""
        if self.queries is not None:
            self.queries = self.queries.index_select(0, index.to(self.queries.device))
            self.positions = self.positions.index_select(0, index.to(self.positions.device))

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors with a token axis at dim 2 (the queries)."""
        return [] if self.queries is None else [self.queries]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.queries, self.slots, self.positions) if t is not None)
