"""Self-speculative decoding: a model drafts with its own compressed :class:`MoENDCache` and verifies with the full
cache (a ``DynamicCache``) of the same weights (the TriForce / MagicDec idea, on one model and no draft weights).

Each round the drafter proposes ``draft_tokens`` greedy tokens per row, one forward each over the compressed cache;
one forward of the full cache verifies them all. A batch keeps, in every row, the shortest prefix that matches the
full cache's own greedy tokens across the rows, plus each row's next token: both caches are cropped by one count
for every row (a ``DynamicCache`` and a recording MoENDCache crop all rows alike), and every kept token is one the
full cache chose in that row, so each row's output is greedy decoding over the full cache (up to the verify step's
chunked arithmetic, a near-tie at most). A row that would have accepted more waits for the batch's shortest: the
batch's acceptance is at most a single row's. It pays where a full-cache decode step costs much more than a
compressed one (long contexts, large batches, memory-bound decode).

The draft cache records its past (``record_past`` = the round's forwards: ``moend_fx.cache.speculation``) and is
cropped back to the accepted tokens after each verification; it keeps ``reserve = draft_tokens + 1`` tokens of
headroom (capacity mode) so an open round always fits its byte budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from moend_fx.cache.hf_attention import ATTN_NAME
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import RoutingPlan


@dataclass(frozen=True)
class SpeculationResult:
    """tokens: [B, n] the new tokens; drafted: draft tokens proposed per row; accepted: kept per row (the batch's
    shortest match each round); row_accepted: matched, summed over the rows (what each row alone would have kept,
    before the batch's shortest); rounds: verify forwards; draft_cache: the compressed cache after the last round;
    decode_seconds: wall time after the prefills."""

    tokens: torch.Tensor
    drafted: int
    accepted: int
    rounds: int
    draft_cache: MoENDCache
    decode_seconds: float
    row_accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Share of the drafted tokens the batch kept."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def row_acceptance(self) -> float:
        """Share of the drafted tokens that matched the full cache's, over every row (>= :attr:`acceptance`)."""
        rows = self.tokens.shape[0]
        return self.row_accepted / (self.drafted * rows) if self.drafted else 0.0


def _forward(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits [B, L, V] of ids [B, L] fed after what ``cache`` holds."""
    return model(ids, cache=cache, use_cache=True).logits


def _check(model: Any, ids: torch.Tensor, max_new_tokens: int, draft_tokens: int) -> None:
    check_int("max_new_tokens", max_new_tokens)
    check_int("draft_tokens", draft_tokens)
    if ids.dim() != 2 or ids.shape[0] < 1:
        raise MoendError(f"ids must be [B, T] (B unpadded rows of the same length); got {tuple(ids.shape)}")
    if model.config._attn_implementation != ATTN_NAME:
        raise MoendError("self-speculation needs the 'moend' attention: call moend_fx.prepare(model, plan) first")


@torch.no_grad()
def self_speculative_generate(model: Any, ids: torch.Tensor, plan: RoutingPlan, *, max_new_tokens: int,
                              draft_tokens: int = 4, full_cache: Any = None, **cache_kw: Any) -> SpeculationResult:
    """Greedy decoding of ``max_new_tokens`` tokens after ids: [B, T] (unpadded rows), drafted over a
    MoENDCache(plan, **cache_kw) and verified over ``full_cache`` (default: a new DynamicCache). ``model`` must use
    the "moend" attention (``moend_fx.prepare(model, plan)``); both caches are prefilled with ids here."""
    _check(model, ids, max_new_tokens, draft_tokens)
    full = full_cache if full_cache is not None else DynamicCache(config=model.config)
    draft = MoENDCache(plan, **{"reserve": draft_tokens + 1, **cache_kw})
    first = _forward(model, ids, full)[:, -1].argmax(-1)
    _forward(model, ids, draft)
    return speculate(model, full, draft, first, max_new_tokens=max_new_tokens, draft_tokens=draft_tokens)


@torch.no_grad()
def speculate(model: Any, full: Any, draft: MoENDCache, first: torch.Tensor, *, max_new_tokens: int,
              draft_tokens: int = 4) -> SpeculationResult:
    """The rounds of :func:`self_speculative_generate` on caches already prefilled with the same tokens: ``first``
    [B] is the full cache's greedy next token (fed to neither cache yet). Only these rounds are timed."""
    check_int("max_new_tokens", max_new_tokens)
    check_int("draft_tokens", draft_tokens)
    for layer in draft.layers:
        layer.activate_past_recording()
        layer.record_past = draft_tokens + 1  # a round's draft forwards stay open until its crop
    seq = first.view(-1, 1)  # [B, n]
    pending, drafted, accepted, matched, rounds = seq, 0, 0, 0, 0
    t0 = time.perf_counter()
    while seq.shape[1] < max_new_tokens:
        k = min(draft_tokens, max_new_tokens - seq.shape[1])
        proposal, feed = [], pending
        for _ in range(k):
            proposal.append(_forward(model, feed, draft)[:, -1:].argmax(-1))  # [B, 1]
            feed = proposal[-1]
        prop = torch.cat(proposal, 1)  # [B, k]
        target = _forward(model, torch.cat([seq[:, -1:], prop], 1), full).argmax(-1)  # [B, k + 1]
        match = (prop == target[:, :k]).long().cumprod(1).sum(1)  # [B]: each row's matching prefix
        n = int(match.min())
        full.crop(-(k - n))  # keeps seq[:, -1] and the n accepted
        if n < k:  # the draft fed pending and prop[:, :k-1]: keep pending and prop[:, :n]
            draft.crop(-(k - 1 - n))
            pending = target[:, n : n + 1]
        else:  # every proposal kept: the last was never fed
            draft.crop(0)
            pending = torch.cat([prop[:, -1:], target[:, n : n + 1]], 1)
        seq = torch.cat([seq, prop[:, :n], target[:, n : n + 1]], 1)
        drafted, accepted, matched, rounds = drafted + k, accepted + n, matched + int(match.sum()), rounds + 1
    return SpeculationResult(seq[:, :max_new_tokens], drafted, accepted, rounds, draft, time.perf_counter() - t0,
                             matched)
