"""When and how far a compressed cache layer evicts: :class:`EvictionPolicy`.

What it evicts (the scorer and the selection) is :class:`moend_fx.eviction.evictor.Evictor`'s, which holds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moend_fx.common.checks import check_choice, check_int
from moend_fx.common.defaults import EVICT_EVERY, QUERY_WINDOW, RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.options import BudgetMode, ReEviction
from moend_fx.plan.memory import keep_count


@dataclass(frozen=True)
class EvictionPolicy:
    """When and how far a layer evicts.

    capacity (``MoENDCache``'s default): a hard byte budget. Each layer never holds more bytes than the plan
    gives it at its ``context_length`` (``moend_fx.eviction.capacity.LayerBudget``), at any generation length:
    after the prompt (and each prefill chunk) it keeps ``keep_count(seen, keep_ratio, floor)`` tokens, or fewer
    if they would not fit, and when the next token would not fit it evicts down to what leaves room for
    ``min(evict_every, G)`` more. A layer that keeps every token starts evicting when the sequence outgrows its
    budget.
    ratio: keep ``keep_count(seen, keep_ratio, floor)`` after the prompt (and each prefill chunk) and re-evict to
    that every ``evict_every`` decode steps; in between a layer grows by up to ``evict_every - 1`` tokens (no
    byte bound: what the memory model predicts holds right after an eviction only).
    reevict: what a re-eviction of a packed layer drops (the prompt is always evicted token by token, before it is
    quantized): ``groups`` (default) drops whole packed groups, so kept codes are never re-quantized; ``tokens``
    drops the lowest-ranked tokens one by one and re-quantizes the survivors (finer, at a re-quantization error
    each time; docs/cache.md, "Re-eviction").
    reserve (capacity mode): tokens of headroom kept free beyond the next one, so a speculative verify step of up
    to ``reserve + 1`` tokens fits without evicting early (``moend_fx.cache.speculation``; 0: none).
    ``seen`` counts a row's real (unmasked) tokens, so padding never earns a row extra tokens. ``floor`` =
    sink_tokens + recent_tokens: an evicting layer keeps at least that many (or all it has) unless its byte
    budget cannot hold them. ``window``: how many recent queries a query-reading scorer scores with.
    """

    budget_mode: BudgetMode = BudgetMode.RATIO  # MoENDCache's default is capacity (it has the plan's budget)
    evict_every: int = EVICT_EVERY
    window: int = QUERY_WINDOW
    sink_tokens: int = SINK_TOKENS
    recent_tokens: int = RECENT_TOKENS
    reevict: ReEviction = ReEviction.GROUPS
    reserve: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget_mode", check_choice("budget_mode", self.budget_mode, BudgetMode))
        object.__setattr__(self, "reevict", check_choice("reevict", self.reevict, ReEviction))
        check_int("evict_every", self.evict_every)
        check_int("window", self.window)
        check_int("reserve", self.reserve, minimum=0)

    @property
    def floor(self) -> int:
        """The fewest tokens an eviction keeps (when there are that many): the sinks plus the recent window."""
        return self.sink_tokens + self.recent_tokens

    @property
    def whole_groups(self) -> bool:
        """Whether a re-eviction of a packed layer drops whole packed groups (else single tokens)."""
        return self.reevict == ReEviction.GROUPS

    @property
    def capped(self) -> bool:
        """Whether a byte budget bounds the layer at every step (capacity mode)."""
        return self.budget_mode == BudgetMode.CAPACITY

    def room(self, group_size: int) -> int:
        """Tokens of room a capacity-mode eviction leaves, so it reruns about this often."""
        return min(self.evict_every, group_size)

    def targets(self, n: int, real_seen: torch.Tensor, real_held: torch.Tensor, *, keep_ratio: float,
                decode_steps: int, chunk: bool) -> torch.Tensor | None:
        """Per-row tokens to keep [B] out of the ``n`` held by the keep ratio, or None when no such eviction is
        due (capacity mode evicts by ratio after a prompt or chunk only; its byte cap is the evictor's).

        real_seen, real_held: [B] real (unmasked) tokens each row has seen and holds; decode_steps: steps so far;
        chunk: right after a prompt or a prefill chunk."""
        if not chunk and (self.capped or decode_steps % self.evict_every):
            return None
        t = torch.tensor([keep_count(int(s), keep_ratio, self.floor) for s in real_seen.tolist()])
        t = torch.minimum(t, real_held.cpu())
        if int(t.max()) >= n:
            return None
        return t
