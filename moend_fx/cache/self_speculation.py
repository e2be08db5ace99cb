"""Self-speculative decoding: a model drafts with its own compressed :class:`MoENDCache` and verifies with the full
cache (a ``DynamicCache``) of the same weights (the TriForce / MagicDec idea, on one model and no draft weights).

Each round the drafter proposes ``draft_tokens`` greedy tokens, one forward each over the compressed cache; one
forward of the full cache verifies them all; the longest prefix that matches the full cache's own greedy tokens is
kept, plus its next token. The output is greedy decoding over the full cache (up to the verify step's chunked
arithmetic, a near-tie at most), produced at the cost of the draft steps plus one full-cache step per round. It
pays where a full-cache decode step costs much more than a compressed one (long contexts, memory-bound decode).

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
    """tokens: [1, n] the new tokens; drafted / accepted: draft tokens proposed and kept; rounds: verify forwards;
    draft_cache: the compressed cache after the last round; decode_seconds: wall time after the two prefills."""

    tokens: torch.Tensor
    drafted: int
    accepted: int
    rounds: int
    draft_cache: MoENDCache
    decode_seconds: float

    @property
    def acceptance(self) -> float:
        """Share of the drafted tokens the full cache kept."""
        return self.accepted / self.drafted if self.drafted else 0.0


def _forward(model: Any, ids: list[int] | torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits [L, V] of ``ids`` fed after what ``cache`` holds (batch 1)."""
    x = ids if isinstance(ids, torch.Tensor) else torch.tensor([ids])
    return model(x, cache=cache, use_cache=True).logits[0]


@torch.no_grad()
def self_speculative_generate(model: Any, ids: torch.Tensor, plan: RoutingPlan, *, max_new_tokens: int,
                              draft_tokens: int = 4, full_cache: Any = None, **cache_kw: Any) -> SpeculationResult:
    """Greedy decoding of ``max_new_tokens`` tokens after ids: [1, T], drafted over a MoENDCache(plan, **cache_kw)
    and verified over ``full_cache`` (default: a new DynamicCache). ``model`` must use the "moend" attention
    (``moend_fx.prepare(model, plan)``); both caches are prefilled with ids here."""
    check_int("max_new_tokens", max_new_tokens)
    check_int("draft_tokens", draft_tokens)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise MoendError(f"ids must be [1, T] (self-speculation decodes one sequence); got {tuple(ids.shape)}")
    if model.config._attn_implementation != ATTN_NAME:
        raise MoendError("self-speculation needs the 'moend' attention: call moend_fx.prepare(model, plan) first")
    full = full_cache if full_cache is not None else DynamicCache(config=model.config)
    draft = MoENDCache(plan, **{"reserve": draft_tokens + 1, **cache_kw})
    seq = [int(_forward(model, ids, full)[-1].argmax())]
    _forward(model, ids, draft)
    for layer in draft.layers:
        layer.activate_past_recording()
        layer.record_past = draft_tokens + 1  # a round's draft forwards stay open until its crop
    pending, drafted, accepted, rounds = [seq[-1]], 0, 0, 0
    t0 = time.perf_counter()
    while len(seq) < max_new_tokens:
        k = min(draft_tokens, max_new_tokens - len(seq))
        proposal, feed = [], pending
        for _ in range(k):
            proposal.append(int(_forward(model, feed, draft)[-1].argmax()))
            feed = proposal[-1:]
        target = _forward(model, [seq[-1], *proposal], full).argmax(-1).tolist()  # [k + 1]
        n = next((i for i in range(k) if proposal[i] != target[i]), k)
        full.crop(-(k - n))  # keeps seq[-1] and the n accepted
        if n < k:  # the draft fed pending and proposal[:k-1]: keep pending and proposal[:n]
            draft.crop(-(k - 1 - n))
            pending = [target[n]]
        else:  # every proposal kept: the last was never fed
            draft.crop(0)
            pending = [proposal[-1], target[n]]
        seq += [*proposal[:n], target[n]]
        drafted, accepted, rounds = drafted + k, accepted + n, rounds + 1
    return SpeculationResult(torch.tensor([seq[:max_new_tokens]]), drafted, accepted, rounds, draft,
                             time.perf_counter() - t0)
