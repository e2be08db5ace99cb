"""``moend bench speculative --ties``: where assisted generation and prompt-lookup decoding on a prepared model give
other greedy tokens than plain greedy decoding with the same plan, how close to a tie the differing token was, set
against the ties ``DynamicCache`` itself shows between a chunked verify and one-by-one decoding.

Per prompt (``n`` tokens of licence text, the 8x plan solved on the table for ``plan_context`` tokens, capacity
mode): plain greedy decoding of ``new_tokens`` tokens on the unprepared model (DynamicCache) and prompt lookup on
it; then, prepared, plain greedy, prompt lookup and assisted generation with the unprepared model as the draft
(``assistant_tokens`` a round, constant). Each variant is compared with its own plain greedy decoding: the first
differing token; the logit drift before it (max |logit difference| over the tokens both produced alike: the
arithmetic's scale); at it, the plain decoding's logit gap between its token and the variant's, and the variant's
gap the other way (both small: a near-tie); the decode-time evictions of the compressed caches (the prompt's
eviction not counted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.plan.routing import RoutingPlan


@dataclass(frozen=True)
class TieSettings:
    """lengths: prompt lengths; plan_context: the plan's context length; reserve: MoENDCache(reserve=...)."""

    lengths: tuple[int, ...] = (1024, 1536, 1900, 2000)
    new_tokens: int = 48
    lookup_tokens: int = 3
    assistant_tokens: int = 4
    budget: str = "8x"
    plan_context: int = 2048
    reserve: int = 0
    seed: int = 0


def _generate(model: Any, ids: torch.Tensor, n: int, **kw: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """n greedy tokens after ids [1, T] and each one's processed scores [V] (float32)."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences[0, ids.shape[1]:], [s[0].float() for s in out.scores]


def _drift(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the finite entries of both (min_new_tokens masks EOS with -inf)."""
    ok = torch.isfinite(a) & torch.isfinite(b)
    return float((a[ok] - b[ok]).abs().max())


def compare(ref: tuple[torch.Tensor, list[torch.Tensor]], got: tuple[torch.Tensor, list[torch.Tensor]]
            ) -> dict[str, Any]:
    """A variant's tokens and scores against plain greedy's: first difference, drift before it, gaps at it."""
    (rt, rs), (gt, gs) = ref, got
    diff = (rt != gt).nonzero()
    first = int(diff[0]) if len(diff) else None
    upto = len(rt) if first is None else first + 1  # the differing token's logits follow the same tokens too
    drifts = [_drift(rs[i], gs[i]) for i in range(upto)]
    row = {"first_difference": first, "drift_max": max(drifts), "drift_median": float(torch.tensor(drifts).median())}
    if first is not None:
        a, b = int(rt[first]), int(gt[first])
        top = rs[first].topk(2).values
        row.update(plain_gap=float(rs[first][a] - rs[first][b]), variant_gap=float(gs[first][b] - gs[first][a]),
                   plain_top2_margin=float(top[0] - top[1]), drift_at=drifts[first])
    return row


def _evictions(cache: MoENDCache) -> int:
    """Evictions after the prompt's (one per evicting layer at the prefill)."""
    return sum(max(layer.evictions - 1, 0) for layer in cache.layers if hasattr(layer, "evictions"))


def measure_prompt(model: Any, draft: Any, ids: torch.Tensor, plan: RoutingPlan, settings: TieSettings,
                   table: Any) -> list[dict[str, Any]]:
    """The rows of one prompt (see the module docstring)."""
    n, rows = settings.new_tokens, []
    plain = _generate(model, ids, n, cache=DynamicCache(config=model.config))
    lookup = _generate(model, ids, n, cache=DynamicCache(config=model.config),
                       prompt_lookup_num_tokens=settings.lookup_tokens)
    rows.append({"cache": "DynamicCache", "variant": "prompt lookup", **compare(plain, lookup)})
    prepare(model, plan, table=table, reserve=settings.reserve)
    try:
        kw = dict(model.__dict__["_moend_prepared"]["cache_kw"])
        caches = {name: MoENDCache(plan, **kw) for name in ("plain", "prompt lookup", "assisted")}
        ref = _generate(model, ids, n, cache=caches["plain"])
        extra = {"prompt lookup": {"prompt_lookup_num_tokens": settings.lookup_tokens},
                 "assisted": {"assistant_model": draft}}
        for name, more in extra.items():
            got = _generate(model, ids, n, cache=caches[name], **more)
            rows.append({"cache": "MoENDCache", "variant": name, **compare(ref, got),
                         "decode_evictions": _evictions(caches[name])})
        rows[0]["plain_decode_evictions"] = _evictions(caches["plain"])
    finally:
        unprepare(model)
    return [{"prompt_tokens": ids.shape[1], **r} for r in rows]


def bench_ties(model: Any, draft: Any, tokenizer: Any, settings: TieSettings, *, table: Any,
               log: Callable[[str], None] = print,
               on_prompt: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every prompt length's rows; the result dict (meta, rows), also given to ``on_prompt`` after each prompt
    (e.g. to write what is measured so far)."""
    from moend_fx.bench.speculative import prompt_ids
    from moend_fx.solvers import get_solver

    draft.generation_config.num_assistant_tokens = settings.assistant_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    plan = get_solver("greedy").solve(table, settings.budget, context_length=settings.plan_context).plan
    meta = {**asdict(settings), "plan": f"greedy on the sensitivity table at {settings.budget} for "
            f"{settings.plan_context} tokens", "torch": torch.__version__}
    result: dict[str, Any] = {"format": "moend_fx.bench.speculative_ties", "version": 1, "meta": meta, "rows": []}
    for i, length in enumerate(settings.lengths):
        rows = measure_prompt(model, draft, prompt_ids(tokenizer, length, settings.seed + i), plan, settings, table)
        result["rows"] += rows
        for r in rows:
            log(f"{length}: {r['cache']} {r['variant']}: first difference {r['first_difference']}, drift max "
                f"{r['drift_max']:.2g}" + (f", gaps {r['plain_gap']:.3g} / {r['variant_gap']:.3g}"
                                           if r["first_difference"] is not None else ""))
        if on_prompt is not None:
            on_prompt(result)
    return result


def ties_markdown(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    lines = ["| prompt tokens | cache | variant | same tokens | drift before (max / median) | "
             "plain's gap at the difference | variant's gap | decode evictions |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        first = r["first_difference"]
        same = "yes" if first is None else f"no (from token {first})"
        gaps = ("", "") if first is None else (f"{r['plain_gap']:.3g}", f"{r['variant_gap']:.3g}")
        ev = r.get("decode_evictions", r.get("plain_decode_evictions", ""))
        lines.append(f"| {r['prompt_tokens']} | {r['cache']} | {r['variant']} | {same} | {r['drift_max']:.2g} / "
                     f"{r['drift_median']:.2g} | {gaps[0]} | {gaps[1]} | {ev} |")
    return "\n".join(lines) + "\n"
