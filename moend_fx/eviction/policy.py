"""When and how far a compressed cache layer evicts: :class:`EvictionPolicy`.

What it evicts (the scorer and the selection) is :class:`moend_fx.eviction.evictor.Evictor`'s, which holds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moend_fx.common.checks import check_choice, check_int
from moend_fx.common.defaults import EVICT_EVERY, QUERY_WINDOW, RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.common.options import BudgetMode
from moend_fx.plan.memory import keep_count


@dataclass(frozen=True)
class EvictionPolicy:
    """When and how far a layer evicts.

    ratio: after the prompt (and after each prefill chunk) keep ``keep_count(seen, keep_ratio, floor)``; during
    decode re-evict to that every ``evict_every`` steps (in between the held count grows by < evict_every).
    capacity: never hold more than ``cap`` tokens; when a new token would exceed it, evict down to
    ``max(cap - slack, min(floor, cap))`` (slack = min(evict_every - 1, cap // 2)) so eviction re-runs about
    every evict_every steps. ``seen`` counts a row's real (unmasked) tokens, so padding never earns a row extra
    tokens. ``floor`` = sink_tokens + recent_tokens: an evicting layer keeps at least that many (or all it has).
    ``window``: how many recent queries a query-reading scorer scores with.
    """

    budget_mode: BudgetMode = BudgetMode.RATIO
    evict_every: int = EVICT_EVERY
    window: int = QUERY_WINDOW
    sink_tokens: int = SINK_TOKENS
    recent_tokens: int = RECENT_TOKENS
    cap: int | None = None  # capacity mode: max(keep_count(plan.context_length, keep_ratio), floor)

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget_mode", check_choice("budget_mode", self.budget_mode, BudgetMode))
        check_int("evict_every", self.evict_every)
        check_int("window", self.window)
        if self.budget_mode == BudgetMode.CAPACITY and (self.cap is None or self.cap < 1):
            raise MoendError(f"capacity mode needs cap >= 1; got cap={self.cap!r}")

    @property
    def floor(self) -> int:
        """The fewest tokens an eviction keeps (when there are that many): the sinks plus the recent window."""
        return self.sink_tokens + self.recent_tokens

    @property
    def low_water(self) -> int:
        assert self.cap is not None
        return max(1, self.cap - min(self.evict_every - 1, self.cap // 2), min(self.floor, self.cap))

    def targets(self, n: int, real_seen: torch.Tensor, real_held: torch.Tensor, *, keep_ratio: float,
                decode_steps: int, chunk: bool) -> torch.Tensor | None:
        """Per-row tokens to keep [B] out of the ``n`` held, or None when no eviction is due.

        real_seen, real_held: [B] real (unmasked) tokens each row has seen and holds; decode_steps: steps so far;
        chunk: right after a prompt or a prefill chunk (ratio mode evicts then whatever the step count)."""
        if self.budget_mode == BudgetMode.RATIO:
            if not chunk and decode_steps % self.evict_every:
                return None
            t = torch.tensor([keep_count(int(s), keep_ratio, self.floor) for s in real_seen.tolist()])
        else:
            if n <= self.cap:
                return None
            t = torch.full_like(real_seen.cpu(), self.low_water)
        t = torch.minimum(t, real_held.cpu())
        if int(t.max()) >= n:
            return None
        return t
