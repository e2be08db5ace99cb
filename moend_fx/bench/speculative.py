"""``moend bench speculative``: self-speculative decoding (``moend_fx.cache.self_speculation``) against plain greedy
decoding over the full cache and over the compressed cache, per context length and batch size.

For each context length ``n``: ``max(batches)`` prompts of ``n`` tokens of licence text (the eval haystack) that
share their first ``n - own_tokens`` tokens and each end in ``own_tokens`` tokens of their own (one prefill of the
shared part, one of each row's end over it: a batch of long prompts without a long prefill per row). The prompts'
first ``n - 1`` tokens are prefilled once at full precision (:func:`moend_fx.eval.steps.prefill`, untimed); every
method builds its cache from that one prefill (a ``DynamicCache`` of its K/V; ``MoENDCache.from_prefill``) and
feeds the last prompt token as its first step (untimed). The MoENDCache plan is solved greedily on the sensitivity
table at ``budget`` for ``n`` tokens (else the uniform plan). A batch of ``B`` takes the first ``B`` rows. Then,
per batch, three decodes of ``new_tokens`` greedy tokens per row: ``full`` (DynamicCache), ``moend`` (MoENDCache,
eager) and ``self-spec`` (drafts over the MoENDCache, verifies over a DynamicCache). Reported: decode tokens/s
over the batch, the ratio to ``full`` at the same context and batch, the acceptance (drafts the batch kept; each
round keeps the batch's shortest match) and the rows' own acceptance, and whether every row's tokens equal the
full cache's greedy tokens.

``lock``: a file the timed decodes of each (context, batch) hold an exclusive ``flock`` on (the prefills run
without it); a process started under ``nice`` runs its timed decodes at priority 0 (:mod:`moend_fx.bench.timed`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from moend_fx.bench.timed import timed_section
from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.cache.self_speculation import speculate
from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.common.io import atomic_write_text
from moend_fx.eval.methods import PrefillState
from moend_fx.eval.steps import prefill
from moend_fx.eval.tasks.text import haystack_sentences
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan


@dataclass(frozen=True)
class SpeculativeBenchSettings:
    """contexts: prompt lengths; batches: rows decoded together; own_tokens: each row's own prompt end;
    new_tokens: greedy tokens decoded per row and method; draft_tokens: per round; budget: solved on the table
    (else ``uniform`` on every layer)."""

    contexts: tuple[int, ...] = (4096,)
    batches: tuple[int, ...] = (1,)
    new_tokens: int = 64
    draft_tokens: int = 4
    budget: str = "8x"
    uniform: LayerConfig = LayerConfig(0.25, 4, 4)
    seed: int = 0
    own_tokens: int = 512


def prompt_ids(tokenizer: Any, length: int, seed: int = 0) -> torch.Tensor:
    """[1, length] token ids of licence text from a seeded start (the eval haystack)."""
    sentences, text, ids = haystack_sentences(random.Random(seed), "licenses"), "", []
    while len(ids) < length:
        text += " ".join(next(sentences) for _ in range(50)) + " "
        ids = tokenizer(text).input_ids
    return torch.tensor([ids[:length]])


def batch_prompts(tokenizer: Any, n: int, rows: int, own: int, seed: int = 0) -> torch.Tensor:
    """[rows, n]: a shared start of ``n - own`` tokens (seed ``seed``), then each row's own ``own`` tokens (seed
    ``seed + 1 + row``)."""
    own = min(own, n - 1)
    shared = prompt_ids(tokenizer, n - own, seed)
    return torch.cat([torch.cat([shared, prompt_ids(tokenizer, own, seed + 1 + r)], 1) for r in range(rows)])


def prefill_rows(model: Any, ids: torch.Tensor, own: int) -> PrefillState:
    """One full-precision prefill of ids [B, n] minus their last token: the rows' shared start once, each row's
    own end over it; the rows' K/V and query windows concatenated along the batch (each row's freed as it goes)."""
    n, own = ids.shape[1], min(own, ids.shape[1] - 1)
    base = prefill(model, ids[0, : n - own].tolist(), window=QUERY_WINDOW)
    rows = [prefill(model, row[n - own : n - 1].tolist(), window=QUERY_WINDOW, base=base) for row in ids]
    kv, queries = [], []
    for i in range(len(base.kv)):
        kv.append(tuple(torch.cat([r.kv[i][j] for r in rows]) for j in (0, 1)))
        queries.append(torch.cat([r.queries[i] for r in rows]))
        for r in rows:
            r.kv[i] = r.queries[i] = None
    return PrefillState(kv, queries, n - 1)


def _rows_of(state: PrefillState, b: int) -> PrefillState:
    return PrefillState([(k[:b], v[:b]) for k, v in state.kv], [q[:b] for q in state.queries], state.length)


def _plan(model: Any, n: int, settings: SpeculativeBenchSettings, table: Any) -> tuple[RoutingPlan, str]:
    if table is not None:
        from moend_fx.solvers import get_solver

        return get_solver("greedy").solve(table, settings.budget, context_length=n).plan, \
            f"greedy on the sensitivity table at {settings.budget}"
    c = settings.uniform
    # snapkv: without a table, trig would have no calibrated statistics (a plan priced for snapkv's window)
    return RoutingPlan.uniform(c, ModelFingerprint.from_model(model), n, scorer="snapkv"), \
        f"uniform keep {c.keep_ratio:g} / K{c.k_bits} / V{c.v_bits}, snapkv"


@torch.no_grad()
def _greedy(model: Any, last: torch.Tensor, cache: Any, n: int) -> tuple[torch.Tensor, float]:
    """n greedy tokens per row after the prompts' last tokens last [B, 1] over a prefilled cache (that first step
    untimed); (tokens [B, n], decode seconds)."""
    out = [model(last, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)]
    t0 = time.perf_counter()
    for _ in range(n - 1):
        out.append(model(out[-1], cache=cache, use_cache=True).logits[:, -1:].argmax(-1))
    return torch.cat(out, 1), time.perf_counter() - t0


def _difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """same_as_full, the first token index where a row differs (None: none) and how many rows differ."""
    diff = a != b
    first = [int(row.nonzero()[0]) for row in diff if row.any()]
    return {"same_as_full": not first, "first_difference": min(first) if first else None,
            "rows_differing": len(first)}


def _row(method: str, n: int, tokens: torch.Tensor, seconds: float, **extra: Any) -> dict[str, Any]:
    b, steps = tokens.shape[0], tokens.shape[1] - 1  # each row's first token comes from the untimed step
    return {"method": method, "context": n, "batch": b, "new_tokens": tokens.shape[1], "decode_s": round(seconds, 3),
            "tokens_per_s": round(b * steps / seconds, 2) if seconds else None, **extra}


def _point(model: Any, plan: RoutingPlan, state: PrefillState, last: torch.Tensor, settings: SpeculativeBenchSettings,
           kw: dict[str, Any], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The three methods on one prefilled batch (rows of ``state``, last tokens [B, 1])."""
    n, b, new, dt = state.length + 1, last.shape[0], settings.new_tokens, settings.draft_tokens
    moend_cache = MoENDCache.from_prefill(plan, state.kv, state.queries, **kw)
    draft = MoENDCache.from_prefill(plan, state.kv, state.queries, **{"reserve": dt + 1, **kw})
    full, t_full = _greedy(model, last, DynamicCache(ddp_cache_data=state.kv), new)
    rows = [_row("full", n, full, t_full)]
    log(f"{n} x{b}: full {rows[-1]['tokens_per_s']} tok/s")
    moend, t_moend = _greedy(model, last, moend_cache, new)
    rows.append(_row("moend", n, moend, t_moend, **_difference(moend, full)))
    log(f"{n} x{b}: moend {rows[-1]['tokens_per_s']} tok/s")
    with torch.no_grad():
        verify = DynamicCache(ddp_cache_data=state.kv)
        first = model(last, cache=verify, use_cache=True).logits[:, -1].argmax(-1)
        model(last, cache=draft, use_cache=True)
    res = speculate(model, verify, draft, first, max_new_tokens=new, draft_tokens=dt)
    rows.append(_row("self-spec", n, res.tokens, res.decode_seconds, acceptance=round(res.acceptance, 3),
                     row_acceptance=round(res.row_acceptance, 3), rounds=res.rounds,
                     **_difference(res.tokens, full)))
    log(f"{n} x{b}: self-spec {rows[-1]['tokens_per_s']} tok/s, acceptance {res.acceptance:.2f} "
        f"(rows alone {res.row_acceptance:.2f})")
    return rows


def bench_speculative(model: Any, tokenizer: Any, settings: SpeculativeBenchSettings, *, table: Any = None,
                      lock: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every context length and batch, three methods each (see the module docstring); the result (meta, rows)."""
    rows, sources = [], {}
    for n in settings.contexts:
        ids = batch_prompts(tokenizer, n, max(settings.batches), settings.own_tokens, settings.seed)
        plan, sources[n] = _plan(model, n, settings, table)
        prepare(model, plan, table=table)
        try:
            kw = dict(model.__dict__["_moend_prepared"]["cache_kw"])
            t0 = time.perf_counter()
            state = prefill_rows(model, ids, settings.own_tokens)
            log(f"{n}: prefill of {ids.shape[0]} rows {time.perf_counter() - t0:.0f} s (untimed)")
            for b in settings.batches:
                with timed_section(lock, log):
                    rows += _point(model, plan, _rows_of(state, b), ids[:b, -1:], settings, kw, log)
            del state
        finally:
            unprepare(model)
    for r in rows:
        base = next(x for x in rows if x["method"] == "full" and (x["context"], x["batch"]) == (r["context"],
                                                                                               r["batch"]))
        r["speed_vs_full"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base["tokens_per_s"] else None
    meta = {**asdict(settings), "uniform": list(asdict(settings.uniform).values()), "plans": sources,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "lock": lock}
    return {"format": "moend_fx.bench.speculative", "version": 2, "meta": meta, "rows": rows}


def markdown_table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    lines = ["| context | batch | method | tokens/s | vs full | acceptance (rows alone) | same tokens as full |",
             "|---:|---:|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        same = "" if "same_as_full" not in r else ("yes" if r["same_as_full"] else
                                                     f"no (from token {r.get('first_difference')})")
        acc = "" if "acceptance" not in r else f"{r['acceptance']:.2f} ({r.get('row_acceptance', 0):.2f})"
        lines.append(f"| {r['context']} | {r.get('batch', 1)} | {r['method']} | {r['tokens_per_s']} | "
                     f"{r['speed_vs_full']} | {acc} | {same} |")
    return "\n".join(lines) + "\n"


def write_results(result: dict[str, Any], out: Path, command: str, name: str = "speculative",
                  markdown: Callable[[dict[str, Any]], str] = markdown_table) -> dict[str, str]:
    """``name``.json and ``name``.md (``markdown`` of it, with the command that made them) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    atomic_write_text(js, json.dumps({**result, "command": command}, indent=1) + "\n")
    atomic_write_text(md, f"`{command}`\n\n" + markdown(result))
    return {"json": str(js), "markdown": str(md)}
