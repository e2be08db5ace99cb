"""``moend bench speculative``: self-speculative decoding (``moend_fx.cache.self_speculation``) against plain greedy
decoding over the full cache and over the compressed cache, at batch 1, per context length.

For each context length ``n``: a prompt of ``n`` tokens of licence text (the eval haystack), the MoENDCache plan
solved greedily on the sensitivity table at ``budget`` for ``n`` tokens (else the uniform plan), then, in one
process, three decodes of ``new_tokens`` greedy tokens each (prefills untimed): ``full`` (DynamicCache), ``moend``
(MoENDCache, eager) and ``self-spec`` (drafts over the MoENDCache, verifies over a DynamicCache). Reported: decode
tokens/s, the ratio to ``full`` in the same run, the draft acceptance rate and whether self-spec's tokens equal the
full cache's greedy tokens (they should: verification keeps only the full cache's greedy tokens).
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

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.cache.self_speculation import self_speculative_generate
from moend_fx.common.io import atomic_write_text
from moend_fx.eval.tasks.text import haystack_sentences
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan


@dataclass(frozen=True)
class SpeculativeBenchSettings:
    """contexts: prompt lengths; new_tokens: greedy tokens decoded per method; draft_tokens: per round; budget:
    solved on the table (else ``uniform`` on every layer); threads: 0 = as set by the caller."""

    contexts: tuple[int, ...] = (4096,)
    new_tokens: int = 64
    draft_tokens: int = 4
    budget: str = "8x"
    uniform: LayerConfig = LayerConfig(0.25, 4, 4)
    seed: int = 0


def prompt_ids(tokenizer: Any, length: int, seed: int = 0) -> torch.Tensor:
    """[1, length] token ids of licence text from a seeded start (the eval haystack)."""
    sentences, text, ids = haystack_sentences(random.Random(seed), "licenses"), "", []
    while len(ids) < length:
        text += " ".join(next(sentences) for _ in range(50)) + " "
        ids = tokenizer(text).input_ids
    return torch.tensor([ids[:length]])


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
def _greedy(model: Any, ids: torch.Tensor, cache: Any, n: int) -> tuple[list[int], float]:
    """n greedy tokens after ids over cache (prefill untimed); (tokens, decode seconds)."""
    tokens = [int(model(ids, cache=cache, use_cache=True).logits[0, -1].argmax())]
    t0 = time.perf_counter()
    for _ in range(n - 1):
        tokens.append(int(model(torch.tensor([tokens[-1:]]), cache=cache, use_cache=True).logits[0, -1].argmax()))
    return tokens, time.perf_counter() - t0


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _row(method: str, n: int, tokens: list[int], seconds: float, **extra: Any) -> dict[str, Any]:
    steps = len(tokens) - 1  # the first token comes from the (untimed) prefill
    return {"method": method, "context": n, "batch": 1, "new_tokens": len(tokens), "decode_s": round(seconds, 3),
            "tokens_per_s": round(steps / seconds, 2) if seconds else None, **extra}


def bench_speculative(model: Any, tokenizer: Any, settings: SpeculativeBenchSettings, *, table: Any = None,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every context length, three methods each (see the module docstring); the result dict (meta, rows)."""
    rows, sources = [], {}
    for n in settings.contexts:
        ids = prompt_ids(tokenizer, n, settings.seed)
        plan, sources[n] = _plan(model, n, settings, table)
        prepare(model, plan, table=table)
        try:
            kw = dict(model.__dict__["_moend_prepared"]["cache_kw"])
            full, t_full = _greedy(model, ids, DynamicCache(config=model.config), settings.new_tokens)
            rows.append(_row("full", n, full, t_full))
            log(f"{n}: full {rows[-1]['tokens_per_s']} tok/s")
            moend, t_moend = _greedy(model, ids, MoENDCache(plan, **kw), settings.new_tokens)
            rows.append(_row("moend", n, moend, t_moend, same_as_full=moend == full,
                             first_difference=_first_difference(moend, full)))
            log(f"{n}: moend {rows[-1]['tokens_per_s']} tok/s")
            res = self_speculative_generate(model, ids, plan, max_new_tokens=settings.new_tokens,
                                            draft_tokens=settings.draft_tokens, **kw)
            spec = res.tokens[0].tolist()
            rows.append(_row("self-spec", n, spec, res.decode_seconds, acceptance=round(res.acceptance, 3),
                             rounds=res.rounds, same_as_full=spec == full,
                             first_difference=_first_difference(spec, full)))
            log(f"{n}: self-spec {rows[-1]['tokens_per_s']} tok/s, acceptance {res.acceptance:.2f}")
        finally:
            unprepare(model)
    for r in rows:
        base = next(x for x in rows if x["method"] == "full" and x["context"] == r["context"])
        r["speed_vs_full"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base["tokens_per_s"] else None
    meta = {**asdict(settings), "uniform": list(asdict(settings.uniform).values()), "plans": sources,
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    return {"format": "moend_fx.bench.speculative", "version": 1, "meta": meta, "rows": rows}


def markdown_table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    lines = ["| context | method | tokens/s | vs full | acceptance | same tokens as full |",
             "|---:|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        same = "" if "same_as_full" not in r else ("yes" if r["same_as_full"] else
                                                     f"no (from token {r.get('first_difference')})")
        acc = "" if "acceptance" not in r else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['context']} | {r['method']} | {r['tokens_per_s']} | {r['speed_vs_full']} | {acc} | "
                     f"{same} |")
    return "\n".join(lines) + "\n"


def write_results(result: dict[str, Any], out: Path, command: str) -> dict[str, str]:
    """speculative.json and speculative.md (with the command that made them) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "speculative.json", out / "speculative.md"
    atomic_write_text(js, json.dumps({**result, "command": command}, indent=1) + "\n")
    atomic_write_text(md, f"`{command}`\n\n" + markdown_table(result))
    return {"json": str(js), "markdown": str(md)}
