"""One method of the decode benchmark on one context length: set the model up, prefill, decode, measure.

See :mod:`moend_fx.bench.decode` for what is measured and why.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moend_fx.bench.capacity import cache_bound
from moend_fx.bench.decode_settings import DecodeBenchSettings
from moend_fx.bench.probes import cache_nbytes, peak_rss_bytes, release_memory, reset_peak_rss, rss_bytes
from moend_fx.cache.generation import decode_compile_settings
from moend_fx.calibration.tables import layer_query_stats
from moend_fx.models.compiled import uncompile
from moend_fx.plan.routing import ModelFingerprint, RoutingPlan
from moend_fx.plan.summary import plan_summary


@dataclass
class DecodeMethod:
    """How one method builds its cache and sets the model up (and undoes it).

    compile_backend: None = eager; "inductor" or "moend". plans: the MoENDCache plan per context length."""

    name: str
    moend: bool
    compile_backend: str | None
    plans: dict[int, RoutingPlan] = field(default_factory=dict)


def _eager(model: Any) -> None:
    uncompile(model)
    torch._dynamo.reset()  # and drop the graphs the last method compiled


def setup_model(model: Any, m: DecodeMethod, settings: DecodeBenchSettings, table: Any) -> None:
    """Prepare (or unprepare) ``model`` for method ``m`` and compile it as the method says."""
    from moend_fx.cache.generation import prepare, unprepare

    _eager(model)
    first = next(iter(m.plans.values()), None)
    if first is not None:
        prepare(model, first, table=table)
    else:
        unprepare(model)
    if m.compile_backend == "inductor":
        model.compile()
    elif m.compile_backend == "moend":
        import moend_fx.compile.backend  # noqa: F401  (registers the backend; also found via the entry point)

        assert first is not None, "the moend backend runs on a MoENDCache method"
        same = all(p.layers == first.layers for p in m.plans.values())
        # The plan only feeds the backend's validate_plan check; per-length plans that differ in their
        # configs would each need their own graphs anyway, so then the check is skipped.
        model.compile(backend="moend", fullgraph=True,
                      options={"plan": first if same else None, "kernel": str(settings.kernel),
                               "inner": str(settings.inner)})


def teardown_model(model: Any) -> None:
    """The model as before the benchmark: eager, unprepared."""
    from moend_fx.cache.generation import unprepare

    _eager(model)
    unprepare(model)


def new_cache(model: Any, m: DecodeMethod, length: int, table: Any, settings: DecodeBenchSettings) -> Any:
    """An empty cache for method ``m`` at context ``length``: a ``DynamicCache``, or a MoENDCache for the
    length's plan (with the table's calibrated query statistics, if it has them, and the settings' eviction
    options)."""
    if not m.moend:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from moend_fx.cache.moend_cache import MoENDCache
    from moend_fx.eviction.rope import rope_from_model

    stats = layer_query_stats(table) if table is not None else None
    return MoENDCache(m.plans[length], rope=rope_from_model(model), query_stats=stats, **settings.cache_kwargs)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each compile and recompile counts one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def decode_steps(model: Any, cache: Any, tok: torch.Tensor, steps: int, times: list[float] | None,
                 graphs: list[int] | None = None) -> torch.Tensor:
    """``steps`` greedy decode steps from ``tok`` [B, 1] (returns the last [B, 1]); each step's time appended to
    ``times`` and the graphs it compiled to ``graphs``, if given.

    A hand-written decode loop over a MoENDCache does what a prepared model's generate() does: the cache's
    before_step hook (deferred eviction, dynamic marks) outside the compiled step; a step's time includes it."""
    before = getattr(cache, "before_step", None) or (lambda: None)
    for _ in range(steps):
        g = compiled_graphs()
        t = time.perf_counter()
        before()
        tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if times is not None:
            times.append(time.perf_counter() - t)
        if graphs is not None:
            graphs.append(compiled_graphs() - g)
    return tok


@torch.no_grad()
def run_one(model: Any, m: DecodeMethod, length: int, settings: DecodeBenchSettings, ids: torch.Tensor,
            table: Any) -> dict[str, Any]:
    """Prefill ``ids`` [B, T] (uncompiled forward), then warm-up and measured decode steps of all B rows at
    once; the row's figures (times are per step: one token for each of the B rows)."""
    release_memory()
    base_rss = rss_bytes()
    reset_peak_rss()
    cache = new_cache(model, m, length, table, settings)
    t0 = time.perf_counter()
    # The uncompiled forward for the prefill: nn.Module.compile hooks __call__ only, and a compiled
    # 8k-token prefill graph is not what this benchmark measures.
    step = settings.prefill_chunk or ids.shape[1]
    for chunk in ids.split(step, dim=1):  # generate's chunked prefill: each chunk through the cache in turn
        out = model.forward(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    tok = out.logits[:, -1:].argmax(-1)
    del out
    prefill_peak = peak_rss_bytes()
    reset_peak_rss()
    settings_ctx = decode_compile_settings() if m.compile_backend == "moend" else contextlib.nullcontext()
    times: list[float] = []
    warm_graphs: list[int] = []
    graphs: list[int] = []
    with settings_ctx:
        warm0 = time.perf_counter()
        tok = decode_steps(model, cache, tok, settings.warmup, None, warm_graphs)
        warmup_s = time.perf_counter() - warm0
        decode_steps(model, cache, tok, settings.steps, times, graphs)
    decode_peak, after = peak_rss_bytes(), rss_bytes()
    row = _cache_figures(model, m, length, int(ids.shape[0]), cache, table)
    del cache
    release_memory()

    def growth(x: int | None) -> int | None:
        return None if x is None or base_rss is None else x - base_rss

    # A measured step that compiled a graph (a recompile the warm-up did not absorb) is left out of the median.
    ms = sorted(t * 1e3 for t, g in zip(times, graphs) if not g) or sorted(t * 1e3 for t in times)
    batch = int(ids.shape[0])
    med = statistics.median(ms)
    return {
        "method": m.name, "tokens": length, "batch": batch, "status": "ok", "reason": None,
        "ms_median": med, "ms_mean": statistics.fmean(ms), "ms_min": ms[0], "ms_max": ms[-1],
        "steps": settings.steps,
        "tokens_per_s": batch / (med / 1e3), "step_ms": [t * 1e3 for t in times], "step_graphs": graphs,
        "compiled_steps": sum(1 for g in graphs if g), "graphs_compiled": sum(warm_graphs) + sum(graphs),
        "prefill_s": prefill_s, "warmup_s": warmup_s, **row,
        "rss_base_bytes": base_rss, "prefill_peak_rss_growth": growth(prefill_peak),
        "decode_peak_rss_growth": growth(decode_peak), "rss_retained_growth": growth(after),
        "plan": plan_summary(m.plans[length]) if m.moend else None,
    }


def _cache_figures(model: Any, m: DecodeMethod, length: int, batch: int, cache: Any, table: Any
                   ) -> dict[str, Any]:
    """The cache's measured bytes after the last step and what the memory model says of them:
    ``model_cache_bytes`` prices what the cache holds (a full cache: every token in the model's dtype; a
    MoENDCache: its held tokens, ``MoENDCache.model_bytes()``); ``cache_bound_bytes`` is the most it may hold
    (:func:`~moend_fx.bench.capacity.cache_bound`, what the capacity estimate uses)."""
    kv, scratch = cache_nbytes(cache)
    held = int(cache.get_seq_length())
    fp = ModelFingerprint.from_model(model)
    plan = m.plans[length] if m.moend else None
    calibrated = table is not None and layer_query_stats(table) is not None
    bound = cache_bound(plan, fp, held, batch, calibrated=calibrated)
    modelled = int(cache.model_bytes().total) if m.moend else bound
    return {"seq_length_after": held, "cache_bytes": kv, "scratch_bytes": scratch,
            "cache_bytes_per_sequence": kv / batch, "model_cache_bytes": modelled, "cache_bound_bytes": bound,
            "cache_matches_model": kv == modelled, "cache_within_bound": kv <= bound}


def unavailable_row(method: str, tokens: int, reason: str, batch: int = 1) -> dict[str, Any]:
    return {"method": method, "tokens": tokens, "batch": batch, "status": "unavailable", "reason": reason}
