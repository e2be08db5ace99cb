"""Streaming pre-RoPE query statistics of one layer: what the ``trig`` scorer reads instead of live queries.

Frequencies are RoPE's pairs in the canonical order of :mod:`moend_fx.eviction.rope` (a partial or interleaved
RoPE is paired as its :class:`~moend_fx.eviction.rope.RopeSpec` says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import RopeSpec, invert_rope, to_complex


@dataclass
class QueryStats:
    """Streaming per-head statistics of one layer's PRE-RoPE queries.

    Holds sums so that calibration can stream sequences and merge workers: ``sum`` [H, D/2, 2]
    (real and imaginary parts of the summed complex query, float64), ``abs_sum`` [H, D/2] (summed
    magnitude per frequency, float64) and ``count`` (queries seen per head). ``mean`` and ``abs_mean``
    give the complex mean ``qbar_f`` and ``E|q_f|`` the ``trig`` scorer uses.
    """

    sum: torch.Tensor
    abs_sum: torch.Tensor
    count: int = 0

    def __post_init__(self) -> None:
        if self.sum.dim() != 3 or self.sum.shape[-1] != 2:
            raise MoendError(f"QueryStats.sum must be [H, D/2, 2]; got {tuple(self.sum.shape)}")
        if tuple(self.abs_sum.shape) != tuple(self.sum.shape[:2]):
            raise MoendError(
                f"QueryStats.abs_sum {tuple(self.abs_sum.shape)} must be [H, D/2] = {tuple(self.sum.shape[:2])}"
            )
        if int(self.count) < 0:
            raise MoendError(f"QueryStats.count={self.count!r}; must be >= 0")
        self.sum = self.sum.detach().to(torch.float64)
        self.abs_sum = self.abs_sum.detach().to(torch.float64)
        self.count = int(self.count)

    @classmethod
    def empty(cls, num_heads: int, head_dim: int) -> QueryStats:
        if num_heads <= 0 or head_dim <= 0 or head_dim % 2:
            raise MoendError(f"QueryStats.empty({num_heads}, {head_dim}): heads > 0, head_dim even > 0")
        f = head_dim // 2
        return cls(torch.zeros(num_heads, f, 2, dtype=torch.float64), torch.zeros(num_heads, f, dtype=torch.float64))

    @property
    def num_heads(self) -> int:
        return self.sum.shape[0]

    @property
    def head_dim(self) -> int:
        return 2 * self.sum.shape[1]

    @staticmethod
    def bytes_for(num_heads: int, head_dim: int) -> int:
        """Bytes a QueryStats of ``num_heads`` heads holds: ``sum`` [H, D/2, 2] and ``abs_sum`` [H, D/2] float64."""
        return num_heads * (head_dim // 2) * 3 * 8

    def nbytes(self) -> int:
        """Bytes of its tensors (what a scorer that holds these statistics keeps alive)."""
        return sum(t.numel() * t.element_size() for t in (self.sum, self.abs_sum))

    def accumulate(self, q_pre: torch.Tensor, mask: torch.Tensor | None = None,
                   spec: RopeSpec | None = None) -> QueryStats:
        """Add pre-RoPE queries in place and return self.

        q_pre: [B, H, T, D]; mask: optional [B, T] bool (True = a real token; padding is skipped); spec: the model's
        RoPE, whose pairs the frequencies follow (:func:`to_complex`; None: full rotate_half).
        """
        if q_pre.dim() != 4 or q_pre.shape[1] != self.num_heads or q_pre.shape[-1] != self.head_dim:
            raise MoendError(f"q_pre must be [B, H={self.num_heads}, T, D={self.head_dim}]; got {tuple(q_pre.shape)}")
        z = to_complex(q_pre.detach().to(torch.float64), spec)  # [B, H, T, F]
        if mask is not None:
            if tuple(mask.shape) != (q_pre.shape[0], q_pre.shape[2]):
                raise MoendError(f"mask must be [B, T] = {(q_pre.shape[0], q_pre.shape[2])}; got {tuple(mask.shape)}")
            w = mask.to(device=z.device, dtype=torch.float64)[:, None, :, None]
            n = int(mask.sum())
        else:
            w = torch.ones((), dtype=torch.float64, device=z.device)
            n = q_pre.shape[0] * q_pre.shape[2]
        s = (z * w).sum(dim=(0, 2)).cpu()  # [H, F]
        self.sum += torch.stack((s.real, s.imag), dim=-1)
        self.abs_sum += (z.abs() * w).sum(dim=(0, 2)).cpu()
        self.count += n
        return self

    def accumulate_rotated(
        self, q_rot: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, mask: torch.Tensor | None = None
    ) -> QueryStats:
        """Un-rotate post-RoPE queries q_rot [B, H, T, D] at positions ([T] or [B, T]) and accumulate."""
        return self.accumulate(invert_rope(q_rot.to(torch.float64), positions, spec), mask, spec)

    def merge(self, other: QueryStats) -> QueryStats:
        """A new QueryStats holding both sets of queries."""
        if self.sum.shape != other.sum.shape:
            raise MoendError(f"cannot merge QueryStats of shapes {tuple(self.sum.shape)} and {tuple(other.sum.shape)}")
        return QueryStats(self.sum + other.sum, self.abs_sum + other.abs_sum, self.count + other.count)

    def _need_data(self) -> None:
        if self.count == 0:
            raise MoendError("QueryStats is empty (count=0): accumulate queries before reading means")

    @property
    def mean(self) -> torch.Tensor:
        """Complex mean pre-RoPE query per head and frequency, qbar: [H, D/2] complex128."""
        self._need_data()
        s = self.sum / self.count
        return torch.complex(s[..., 0], s[..., 1])

    @property
    def abs_mean(self) -> torch.Tensor:
        """Mean magnitude per head and frequency, E|q_f|: [H, D/2] float64."""
        self._need_data()
        return self.abs_sum / self.count

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Plain tensors for safetensors: ``{prefix}sum`` [H, D/2, 2], ``{prefix}abs_sum`` [H, D/2] (float64),
        ``{prefix}count`` [] int64."""
        return {
            f"{prefix}sum": self.sum.clone(),
            f"{prefix}abs_sum": self.abs_sum.clone(),
            f"{prefix}count": torch.tensor(self.count, dtype=torch.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any], prefix: str = "") -> QueryStats:
        """Inverse of :meth:`to_tensors` (numpy arrays are accepted too)."""
        keys = [f"{prefix}sum", f"{prefix}abs_sum", f"{prefix}count"]
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise MoendError(f"query stats tensors missing {missing}; present: {sorted(tensors)[:10]}")
        s, a, c = (torch.as_tensor(tensors[k]) for k in keys)
        return cls(s, a, int(c.reshape(-1)[0]) if c.numel() else 0)
