"""The window of recent queries a query-reading scorer scores with (working memory, not cache bytes)."""

from __future__ import annotations

import torch


class QueryWindow:
    """The last ``size`` post-RoPE queries a layer saw, with their logical slots and RoPE positions.

    queries: [B, H, W, D]; slots: [W] int64 (columns of HF's logical mask); positions: [B, W] int64 (what RoPE
    rotated them by: slot - the row's left-padding offset). W <= size; all None until the first :meth:`push`.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.queries: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def push(self, queries: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Add the newest queries [B, H, L, D] at slots [L] and RoPE positions [B, L]; keep the last ``size``."""
        w = self.size
        q, slots, positions = queries[:, :, -w:], slots[-w:], positions[:, -w:]
        if self.queries is not None and q.shape[2] < w:
            q = torch.cat([self.queries, q], dim=2)[:, :, -w:]
            slots = torch.cat([self.slots, slots])[-w:]
            positions = torch.cat([self.positions, positions], dim=1)[:, -w:]
        self.queries, self.slots, self.positions = q.detach(), slots, positions

    def select(self, row: int | None = None, keep: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(queries [b, H, w, D], positions [b, w]) of batch row ``row`` (b = 1; None = every row), only the
        window queries ``keep`` [W] bool marks (None = all); (None, None) before the first push."""
        if self.queries is None:
            return None, None
        q, pos = self.queries, self.positions
        if row is not None:
            q, pos = q[row : row + 1], pos[row : row + 1]
        if keep is not None:
            q, pos = q[:, :, keep], pos[:, keep]
        return q, pos

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` [B'] (beam search, batch selection)."""
        if self.queries is not None:
            self.queries = self.queries.index_select(0, index.to(self.queries.device))
            self.positions = self.positions.index_select(0, index.to(self.positions.device))

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors with a token axis at dim 2 (the queries)."""
        return [] if self.queries is None else [self.queries]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.queries, self.positions) if t is not None)
