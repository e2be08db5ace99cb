"""The byte budget of one cache layer: what it may hold in ``budget_mode="capacity"`` and what it holds.

A plan promises bytes: ``plan_bytes(plan)`` at its ``context_length``. In capacity mode each layer gets the bytes
the memory model gives it there (:meth:`LayerBudget.cap`, its eviction state included) and never holds more, at
any length: the layers' caps sum to the plan's bytes, so the whole cache keeps the plan's promise at every step.
A layer evicts when the next token would not fit, down to a count that leaves room for the next ``room`` tokens
(so eviction reruns about every ``room`` steps, not at every one).

Bytes are not monotonic in tokens (a full group packs; a partial one stays in the 16-bit residual window), so a
count "fits" only when every count up to ``room`` tokens later fits too. The same :class:`LayerBudget` prices what
the layer holds (``MoENDCache.model_bytes``), so the cap and the measurement are one count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import keep_count, layer_bytes
from moend_fx.plan.routing import LayerConfig
from moend_fx.plan.scorer_state import scorer_state_bytes

CHECK_AHEAD = 256  # how many future tokens one fit check covers (a layer far below its cap rechecks this often)


@dataclass(frozen=True)
class LayerBudget:
    """The memory model of one cache layer, with its plan's context length.

    scorer / calibrated: the layer's scorer name (None: it has none) and whether it holds calibrated statistics;
    floor: the plan's kept-token floor (sinks + recent window); window: the query window's size."""

    config: LayerConfig
    context_length: int
    kv_heads: int
    num_heads: int
    head_dim: int
    group_size: int
    floor: int
    window: int
    scorer: str | None
    calibrated: bool

    def storage(self, kept: int, slots: int, *, batch: int, dtype: Any, positions: bool) -> int:
        """Bytes of a PackedKV holding ``kept`` tokens out of ``slots`` (positions stored or not)."""
        return layer_bytes(self.config, 0, kv_heads=self.kv_heads, head_dim=self.head_dim, batch=batch,
                           group_size=self.group_size, dtype=dtype, kept=kept, slots=slots, positions=positions)

    def state(self, slots: int, queries: int, *, batch: int, evicts: bool) -> int:
        """Bytes of the eviction state of a layer of ``slots`` slots whose window has seen ``queries`` queries
        (0 for a layer that does not evict)."""
        return scorer_state_bytes(self.config, slots, scorer=self.scorer, num_heads=self.num_heads,
                                  head_dim=self.head_dim, batch=batch, window=self.window,
                                  calibrated=self.calibrated, evicts=evicts, queries=queries)

    def held(self, kept: int, slots: int, queries: int, *, batch: int, dtype: Any, evicting: bool) -> int:
        """Every byte of the layer: its storage and its eviction state."""
        return (self.storage(kept, slots, batch=batch, dtype=dtype, positions=evicting)
                + self.state(slots, queries, batch=batch, evicts=evicting))

    def cap(self, *, batch: int, dtype: Any) -> int:
        """The bytes the plan gives this layer: what it holds after a prompt of ``context_length`` tokens."""
        t = self.context_length
        n = keep_count(t, self.config.keep_ratio, self.floor if self.config.evicts else 0)
        return self.held(n, t, t, batch=batch, dtype=dtype, evicting=self.config.evicts)

    def steps_that_fit(self, kept: int, slots: int, queries: int, *, batch: int, dtype: Any, evicting: bool,
                       limit: int = CHECK_AHEAD) -> int:
        """How many more tokens (0..limit) can arrive, one per step, before the layer would exceed its cap."""
        cap = self.cap(batch=batch, dtype=dtype)
        for j in range(1, limit + 1):
            if self.held(kept + j, slots + j, queries + j, batch=batch, dtype=dtype, evicting=evicting) > cap:
                return j - 1
        return limit

    def target(self, candidates: Sequence[int], slots: int, queries: int, *, batch: int, dtype: Any,
               room: int, strict: bool = False, need: int = 1) -> int | None:
        """The count an eviction leaves, out of ``candidates`` (ascending token counts it can leave): the largest
        that fits now and leaves room for the next ``room`` tokens, unless that costs more than one group's worth
        of tokens against the largest that fits now and the next token (a small cap, where the 16-bit residual
        window's swing would cost most of the layer: it keeps its tokens and evicts more often instead); None if
        none fits. strict: only a count that leaves the room (None if none does: a speculative step's tokens); need:
        the tokens "the next" means (1, or 1 + the policy's reserve).

        A count fits when it and every count up to ``ahead`` tokens later stay within the cap. Over ``room`` tokens
        that is monotonic in the count (up to a partial group's jitter, which the final check absorbs), so a long
        ``range`` is bisected rather than scanned."""
        cap = self.cap(batch=batch, dtype=dtype)

        def fits(m: int, ahead: int) -> bool:
            return m >= 1 and all(
                self.held(m + j, slots + j, queries + j, batch=batch, dtype=dtype, evicting=True) <= cap
                for j in range(ahead + 1))

        def largest(ahead: int) -> int | None:
            lo, hi = 0, len(candidates)  # invariant: candidates[:lo] fit (as far as bisection tells)
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(candidates[mid], ahead):
                    lo = mid + 1
                else:
                    hi = mid
            return next((candidates[i] for i in range(lo - 1, -1, -1) if fits(candidates[i], ahead)), None)

        # one token ahead is not monotonic (a count just below a group boundary holds a full residual window):
        # scan down from the top, where a fit is found within about a group
        tight = next((m for m in reversed(candidates) if fits(m, need)), None)
        roomy = largest(room)
        if strict or (roomy is not None and (tight is None or tight - roomy <= self.group_size)):
            return roomy
        return tight

    def check_fits_one(self, slots: int, queries: int, *, batch: int, dtype: Any, layer_idx: int) -> None:
        """A MoendError when even one token plus the eviction state exceeds the cap (a plan too small to run)."""
        cap = self.cap(batch=batch, dtype=dtype)
        need = self.held(2, slots + 1, queries + 1, batch=batch, dtype=dtype, evicting=True)
        if need > cap:
            raise MoendError(f"layer {layer_idx} ({self.config.name}): its budget of {cap} B cannot hold even two "
                             f"tokens and its eviction state ({need} B); solve the plan for a larger budget or use "
                             "budget_mode='ratio'")
