"""Prefill benchmark (``moend bench prefill``): one-shot vs chunked prefill of one long prompt, time, peak RSS
growth and what chunking costs in accuracy.

Each mode runs in a fresh Python process (``python -m moend_fx.bench.prefill SPEC``), so one mode's RSS peak
and allocator state never mix with another's. In the child: load the model, warm it up with a short prompt
through the same path (so the weights' pages are resident and lazily built state exists), trim the heap, take
the baseline RSS, reset the kernel's peak mark (``/proc/self/clear_refs``) and run ``generate`` on a passkey
prompt of ``length`` tokens (the whole prompt, question included, is prefilled: the query-aware setting).
``_prefill`` is timed and the peak RSS (VmHWM) is read when it returns; then ``new_tokens`` greedy tokens are
decoded and scored. The children run with a fixed glibc mmap threshold (:data:`MALLOC_ENV`) unless
``malloc="default"``. Modes (``MODES``):

* ``one_shot``: MoENDCache, the prompt in one pass (each layer's full-precision K/V live only while that layer
  runs; the MLP and attention activations of every prompt token are the transient memory);
* ``chunked``: MoENDCache, chunks of ``chunk`` tokens (``moend_fx.prepare(..., prefill_chunk=chunk)``): each
  chunk is compressed before the next is fed, so earlier chunks are evicted before the question is seen;
* ``full``: a plain DynamicCache (sdpa), one pass: the uncompressed reference.

Accuracy cost of chunking (against ``one_shot`` with the same plan): passkey correctness, agreement of the greedy
tokens, and the KL divergence and top-1 agreement of the first generated token's distribution.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moend_fx.bench.child import child_main
from moend_fx.bench.decode_settings import DEFAULT_UNIFORM
from moend_fx.bench.probes import cache_nbytes, peak_rss_bytes, release_memory, reset_peak_rss, rss_bytes
from moend_fx.common.checks import check_int, check_names
from moend_fx.common.defaults import PREFILL_CHUNK
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_text
from moend_fx.plan.config import LayerConfig

MODES: tuple[str, ...] = ("one_shot", "chunked", "full")
# glibc's default (dynamic) mmap threshold keeps freed tensor buffers in per-thread heaps, so RSS counts memory no
# tensor holds (a SmolLM2 2k prefill in 512-token chunks on 2 threads: 547 MB over its baseline by default, 48 MB
# with this fixed threshold, 71 MB with MALLOC_ARENA_MAX=1). Fixed, every buffer over 128 kB is its own mapping,
# returned on free: RSS follows live memory.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MALLOCS: tuple[str, ...] = ("fixed", "default")
DEFAULT_MODES: tuple[str, ...] = ("one_shot", "chunked")
WARMUP_TOKENS = 64  # the warm-up prompt: touches every weight page and builds the lazy state, costs ~nothing


@dataclass(frozen=True)
class PrefillBenchSettings:
    """What to run: ``examples`` passkey prompts of ``length`` tokens per mode, ``chunk`` tokens per prefill chunk
    in ``chunked`` mode; the plan is greedy on a table at ``budget`` (16-bit base) if one is given, else
    ``uniform`` on every layer, solved for ``length``."""

    length: int = 8000  # SmolLM2 (the default model) holds 8192 positions: the prompt and its answer fit
    chunk: int = PREFILL_CHUNK
    modes: tuple[str, ...] = DEFAULT_MODES
    examples: int = 1
    new_tokens: int = 8
    budget: str = "14x"
    uniform: LayerConfig = DEFAULT_UNIFORM
    seed: int = 0
    threads: int = 0
    malloc: str = "fixed"

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", check_names("modes", "mode", self.modes, MODES, unique=True))
        check_names("malloc", "malloc", (self.malloc,), MALLOCS)
        check_int("length", self.length, minimum=WARMUP_TOKENS + 1)
        check_int("chunk", self.chunk, minimum=2)
        if self.chunk >= self.length:
            raise MoendError(f"chunk={self.chunk} is invalid for length={self.length}; allowed: 2 <= chunk < "
                             "length (a chunk as long as the prompt is the one-shot prefill)")
        check_int("examples", self.examples)
        check_int("new_tokens", self.new_tokens)
        check_int("threads", self.threads, minimum=0)
        if not isinstance(self.uniform, LayerConfig):
            raise MoendError(f"uniform must be a LayerConfig; got {type(self.uniform).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), uniform=self.uniform.to_dict(), modes=list(self.modes))


# --------------------------------------------------------------------------------------------- parent


def bench_prefill(model_name: str, settings: PrefillBenchSettings, *, table: str | None = None,
                  plan: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Run every mode in its own process, one after the other; returns ``{"meta", "rows", "cost"}``."""
    if table and plan:
        raise MoendError("give --table or --plan, not both")
    if plan and not Path(plan).is_file():
        raise MoendError(f"plan file {plan!r} does not exist")
    with tempfile.TemporaryDirectory(prefix="moend-prefill-") as tmp:  # the children's specs, rows and logits
        work = Path(tmp)
        rows = [_run_mode(mode, i, model_name, settings, table, plan, progress, work)
                for i, mode in enumerate(settings.modes)]
        cost = _chunking_cost(rows, work) if {"one_shot", "chunked"} <= set(settings.modes) else None
    meta = {"model_name": model_name, "settings": settings.to_dict(), "table": table, "plan": plan,
            "torch": torch.__version__}
    return {"format": "moend_fx.bench.prefill", "version": 1, "meta": meta, "rows": rows, "cost": cost}


def _run_mode(mode: str, i: int, model_name: str, settings: PrefillBenchSettings, table: str | None,
              plan: str | None, progress: bool, work: Path) -> dict[str, Any]:
    """Run one mode in a fresh process (``python -m moend_fx.bench.prefill SPEC``) and return its row."""
    print(f"bench prefill: {mode} ({i + 1}/{len(settings.modes)}) in a fresh process", file=sys.stderr, flush=True)
    spec = {"model": model_name, "mode": mode, "settings": settings.to_dict(), "table": table, "plan": plan,
            "progress": progress, "result": str(work / f"{mode}.json"), "logits": str(work / f"{mode}.pt")}
    spec_path = atomic_write_text(work / f"{mode}.spec.json", json.dumps(spec, indent=1) + "\n")
    env = dict(os.environ, **(MALLOC_ENV if settings.malloc == "fixed" else {}))
    subprocess.run([sys.executable, "-m", "moend_fx.bench.prefill", str(spec_path)], check=False, env=env)
    result = Path(spec["result"])
    row = json.loads(result.read_text()) if result.is_file() else {"error": "the child process died"}
    if "error" in row:
        raise MoendError(f"bench prefill, mode {mode}: {row['error']}")
    return row


def _chunking_cost(rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Chunked against one-shot, per example: the KL and top-1 agreement of the first generated token's
    distribution, the share of greedy tokens that agree (up to the first difference), both passkey scores."""
    one, chunked = (next(r for r in rows if r["mode"] == m) for m in ("one_shot", "chunked"))
    ref, got = torch.load(out / "one_shot.pt"), torch.load(out / "chunked.pt")
    kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1)  # KL(one-shot || chunked)
    per = []
    for i, (a, b) in enumerate(zip(one["examples"], chunked["examples"])):
        same = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        per.append({"kl_first_token": float(kl[i]), "top1_agrees": bool(ref[i].argmax() == got[i].argmax()),
                    "greedy_prefix_agreement": same / len(a["tokens"]), "score_one_shot": a["score"],
                    "score_chunked": b["score"]})
    n = len(per)
    return {"examples": per, "mean_kl_first_token": sum(p["kl_first_token"] for p in per) / n,
            "top1_agreement": sum(p["top1_agrees"] for p in per) / n,
            "greedy_prefix_agreement": sum(p["greedy_prefix_agreement"] for p in per) / n,
            "accuracy_one_shot": one["accuracy"], "accuracy_chunked": chunked["accuracy"]}


def markdown_table(result: dict[str, Any]) -> str:
    """The rows (one per mode) and the accuracy cost of chunking, as Markdown."""
    s = result["meta"]["settings"]
    first = result["rows"][0]
    lines = [f"Model `{result['meta']['model_name']}`, passkey prompt of {first['tokens']} tokens "
             f"(target {s['length']}), {s['examples']} example(s), chunk {s['chunk']} tokens, "
             f"{first['threads']} threads; plan: {first['plan_source']} ({first['plan_ratio_16bit']:.1f}x of a "
             f"16-bit cache). Each mode in a fresh process ({_malloc_note(s['malloc'])}); RSS growth = peak "
             "during the prefill - RSS after load and warm-up.", "",
             "| mode | prefill | tokens/s | baseline RSS | peak RSS growth | cache after prefill | budget | "
             "passkey |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        budget = "" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 1e6:.2f} MB"
        lines.append(f"| {r['mode']} | {r['prefill_s']:.1f} s | {r['tokens'] / r['prefill_s']:.0f} | "
                     f"{r['baseline_rss'] / 1e6:.0f} MB | {r['peak_rss_growth'] / 1e6:.0f} MB | "
                     f"{r['cache_bytes'] / 1e6:.2f} MB | {budget} | {r['accuracy'] * r['n']:.0f}/{r['n']} |")
    c = result.get("cost")
    if c:
        lines += ["", "Accuracy cost of chunking (chunked vs one-shot, same plan): "
                  f"KL(one-shot || chunked) of the first answer token {c['mean_kl_first_token']:.4f} nats, top-1 "
                  f"agreement {c['top1_agreement']:.0%}, greedy tokens agreeing up to the first difference "
                  f"{c['greedy_prefix_agreement']:.0%}, passkey {c['accuracy_one_shot']:.0%} one-shot vs "
                  f"{c['accuracy_chunked']:.0%} chunked."]
    return "\n".join(lines) + "\n"


def _malloc_note(malloc: str) -> str:
    if malloc == "fixed":
        return "glibc `MALLOC_MMAP_THRESHOLD_=131072`, so RSS follows live memory"
    return "glibc's default allocator settings, freed buffers retained"


def write_prefill(result: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``prefill.json`` and ``prefill.md`` under ``out``."""
    out = Path(out)
    return {"json": atomic_write_text(out / "prefill.json", json.dumps(result, indent=1) + "\n"),
            "markdown": atomic_write_text(out / "prefill.md", markdown_table(result))}


# --------------------------------------------------------------------------------------------- child


def _setup(spec: dict[str, Any], settings: PrefillBenchSettings) -> tuple[Any, Any, Any, str]:
    """Load the model, solve the plan and prepare the model for ``spec["mode"]``: (model, tokenizer, plan, source)."""
    from moend_fx.bench.decode import DecodeBenchSettings, all_cores, plan_for_length
    from moend_fx.cache.generation import prepare
    from moend_fx.calibration.tables import load_table
    from moend_fx.models import load_model
    from moend_fx.plan.routing import RoutingPlan

    torch.set_num_threads(settings.threads or all_cores())
    model, tok = load_model(spec["model"])
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and settings.length + settings.new_tokens > max_pos:
        raise MoendError(f"length {settings.length} + new_tokens {settings.new_tokens} exceeds the model's "
                         f"max_position_embeddings={max_pos}")
    table = load_table(spec["table"]) if spec["table"] else None
    given = RoutingPlan.load(spec["plan"]) if spec["plan"] else None
    dec = DecodeBenchSettings(budget=settings.budget, uniform=settings.uniform)
    plan, source = plan_for_length(model, settings.length, dec, table=table, plan=given)
    if spec["mode"] != "full":
        chunk = settings.chunk if spec["mode"] == "chunked" else None
        prepare(model, plan, table=table, prefill_chunk=chunk, prefill_chunk_above=0)
    return model, tok, plan, source


def _timed_prefill(model: Any, record: dict[str, Any], bar: Any) -> None:
    """Wrap the model's ``_prefill`` so each call records its time, the peak RSS and the cache bytes it leaves."""
    inner = model._prefill

    def timed(input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any):
        reset_peak_rss()
        bar.reset()
        t0 = time.perf_counter()
        out = inner(input_ids, generation_config, model_kwargs, *args, **kwargs)
        record["prefill_s"] = time.perf_counter() - t0
        record["peak_rss"] = peak_rss_bytes()
        cache = model_kwargs.get("cache")
        record["cache_bytes"] = cache_nbytes(cache)[0]
        record["budget_bytes"] = cache.budget_bytes().total if hasattr(cache, "budget_bytes") else None
        return out

    model._prefill = timed


def _progress_bar(model: Any, total: int, desc: str, enabled: bool) -> Any:
    """A bar (with ETA) over the prefill's layer passes: a forward hook on every decoder layer ticks it."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="layer", disable=not enabled, mininterval=5)

    def tick(*_: Any) -> None:  # returns None: a forward hook's return value would replace the layer's output
        if bar.n < bar.total:  # decode steps after the prefill do not count
            bar.update(1)

    for layer in model.model.layers:
        layer.register_forward_hook(tick)
    return bar


@torch.no_grad()
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One mode in this (fresh) process: the row of the result and the first-token log-probs [examples, vocab]."""
    from moend_fx.eval.tasks.registry import make_examples, score
    from moend_fx.models import model_name
    from moend_fx.plan.memory import full_cache_bytes, plan_bytes

    settings = PrefillBenchSettings(**dict(spec["settings"], uniform=LayerConfig.from_dict(spec["settings"]["uniform"]),
                                           modes=tuple(spec["settings"]["modes"])))
    model, tok, plan, source = _setup(spec, settings)
    examples = make_examples("passkey", tok, settings.length, settings.examples, seed=settings.seed)
    prompts = [tok(ex.prompt_full, return_tensors="pt").input_ids for ex in examples]
    gen = dict(do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id, return_dict_in_generate=True,
               output_logits=True)
    model.generate(prompts[0][:, :WARMUP_TOKENS], max_new_tokens=2, **gen)  # weights resident, lazy state built
    release_memory()
    baseline, record = rss_bytes(), {}
    n_chunks = 1 if spec["mode"] != "chunked" else math.ceil(prompts[0].shape[1] / settings.chunk)
    bar = _progress_bar(model, n_chunks * len(model.model.layers), f"prefill {spec['mode']}", spec["progress"])
    _timed_prefill(model, record, bar)
    rows, logprobs = [], []
    for ex, ids in zip(examples, prompts):
        out = model.generate(ids, max_new_tokens=settings.new_tokens, **gen)
        new = out.sequences[0, ids.shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        rows.append({"tokens": new, "text": text, "score": score(ex, text), "prefill_s": record["prefill_s"],
                     "peak_rss_growth": record["peak_rss"] - baseline, "cache_bytes": record["cache_bytes"]})
        logprobs.append(torch.log_softmax(out.logits[0][0].float(), -1))
        release_memory()
    bar.close()
    torch.save(torch.stack(logprobs), spec["logits"])
    n = len(rows)
    return {"mode": spec["mode"], "model": model_name(model), "tokens": prompts[0].shape[1], "n": n,
            "chunks": n_chunks, "threads": torch.get_num_threads(), "plan_source": source,
            "plan_ratio_16bit": full_cache_bytes(plan.fingerprint, settings.length) / plan_bytes(plan, settings.length),
            "baseline_rss": baseline, "prefill_s": sum(r["prefill_s"] for r in rows) / n,
            "peak_rss_growth": max(r["peak_rss_growth"] for r in rows), "cache_bytes": rows[-1]["cache_bytes"],
            "budget_bytes": record["budget_bytes"], "accuracy": sum(r["score"] for r in rows) / n,
            "examples": rows}


def _child_main(spec_path: str) -> int:
    return child_main(spec_path, run_child)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
