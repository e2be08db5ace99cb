"""Decode benchmark: per-token time and memory of full vs compressed caches, eager vs compiled, in one run.

For each method and context length ``n``: prefill ``n - warmup - steps`` random token ids once (uncompiled
forward, last logits only), then greedy decode ``warmup + steps`` tokens one at a time, so the last step
runs at ``n`` tokens (the model's limit is reachable), and take the median of the last ``steps`` step
times. With ``batches`` (at ``batch_lengths``), the same with ``B`` rows of random tokens decoded together:
``ms_median`` is then the time of one step (one token for each row) and ``tokens_per_s = B / step seconds``.
Methods (``METHODS``):

* ``full_eager``: HF ``DynamicCache``, sdpa attention: the baseline every ratio is taken against;
* ``full_inductor``: the same after ``model.compile()`` (inductor);
* ``moend_eager``: :class:`~moend_fx.cache.moend_cache.MoENDCache` for the plan, reference attention;
* ``moend_compiled``: the same after ``model.compile(backend="moend", options={"plan": ...})``.

A method that fails (e.g. the backend is missing or raises) gives a row with ``status="unavailable"`` and
the reason, and the run goes on. Memory: the cache's own tensor bytes (``nbytes()`` for MoENDCache, K/V
tensor bytes for DynamicCache) and the process RSS growth (peak during prefill, peak during decode, and
retained after decode; glibc keeps freed memory, so RSS figures are upper bounds and noisy). Roofline:
every decode step must read the weights and the whole cache once, so it takes at least
``(weight bytes + cache bytes) / bandwidth`` (design.md: ~27-30 GB/s here). Each row also checks the cache's
measured bytes against the memory model (``model_cache_bytes``, ``cache_bound_bytes``); with ``memory_cap`` the
result's ``fit`` holds the largest batch of each method under the cap, predicted from the memory model
(:mod:`moend_fx.bench.capacity`). Cold and warm compile times run in fresh processes:
:mod:`moend_fx.bench.compile_time`.

Compile time shows in ``warmup_s`` (the warm-up steps of the first length pay it). A MoENDCache re-evicts
every 128 generated tokens; with the default 16 steps no re-eviction falls inside the measured window.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

import torch

from moend_fx.bench import decode_run as run
from moend_fx.bench.capacity import ModelShape, fit_rows
from moend_fx.bench.decode_report import markdown_table, plot_decode, write_decode
from moend_fx.bench.decode_run import DecodeMethod, unavailable_row
from moend_fx.bench.decode_settings import (
    BASELINE,
    DEFAULT_BANDWIDTH_GBS,
    DEFAULT_LENGTHS,
    DEFAULT_UNIFORM,
    METHODS,
    DecodeBenchSettings,
    parse_batches,
    parse_methods,
)
from moend_fx.bench.probes import cache_nbytes, rss_bytes, weight_bytes
from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import format_bytes, full_cache_bytes, plan_bytes
from moend_fx.plan.routing import ModelFingerprint, RoutingPlan
from moend_fx.plan.summary import plan_summary

__all__ = ["BASELINE", "DEFAULT_BANDWIDTH_GBS", "DEFAULT_LENGTHS", "DEFAULT_UNIFORM", "METHODS",
           "DecodeBenchSettings", "add_ratios", "all_cores", "bench_decode", "cache_nbytes", "markdown_table",
           "parse_batches", "parse_methods", "plan_for_length", "plan_summary", "plot_decode", "rss_bytes",
           "weight_bytes", "write_decode"]


def all_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_for_length(model: Any, length: int, settings: DecodeBenchSettings, *, table: Any = None,
                    plan: RoutingPlan | None = None) -> tuple[RoutingPlan, str]:
    """The MoENDCache plan for one context length and a sentence saying where it came from."""
    fp = ModelFingerprint.from_model(model)
    if plan is not None:
        plan.check_model(fp)
        return plan, f"given plan ({plan.solver}, solved for {plan.context_length} tokens)"
    if table is not None:
        from moend_fx.solvers import get_solver

        res = get_solver("greedy").solve(table, settings.budget, context_length=length)
        res.plan.check_model(fp)
        return res.plan, f"greedy on the sensitivity table for budget {settings.budget} (16-bit base)"
    c = settings.uniform
    # priced for the cache it runs in: no table, so the scorer has no calibrated query statistics
    p = RoutingPlan.uniform(c, fp, length, calibrated=False)
    return p, f"hand-written uniform plan: keep {c.keep_ratio:g} / K{c.k_bits} / V{c.v_bits} on every layer"


# --------------------------------------------------------------------------------------------- the run


def bench_decode(model: Any, settings: DecodeBenchSettings | None = None, *, table: Any = None,
                 plan: RoutingPlan | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every method at every context length on ``model`` (in eval mode, on CPU); return the result dict
    (``meta`` and ``rows``; see :func:`add_ratios` for the derived columns). Threads: as set by the caller."""
    settings = settings or DecodeBenchSettings()
    _check_run(model, settings, table, plan)
    methods, plan_source = _methods(model, settings, table, plan)
    rows = _run_all(model, methods, settings, table, progress, log or (lambda s: None))
    result = {"format": "moend_fx.bench.decode", "version": 1,
              "meta": _meta(model, settings, methods, plan_source), "rows": rows,
              "fit": _fit(model, settings, methods, table)}
    return add_ratios(result)


def _fit(model: Any, settings: DecodeBenchSettings, methods: list[DecodeMethod], table: Any
         ) -> list[dict[str, Any]] | None:
    """The largest batch of every method under ``settings.memory_cap`` (predicted), or None without a cap."""
    cap = settings.memory_cap_bytes
    if cap is None:
        return None
    from moend_fx.calibration.tables import layer_query_stats

    calibrated = table is not None and layer_query_stats(table) is not None
    plans = {m.name: (dict(m.plans) if m.moend else None) for m in methods}
    return fit_rows(plans, settings.lengths, ModelShape.from_model(model), weight_bytes(model), cap,
                    calibrated=calibrated)


def _check_run(model: Any, settings: DecodeBenchSettings, table: Any, plan: RoutingPlan | None) -> None:
    if plan is not None and table is not None:
        raise MoendError("give a plan or a table, not both")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and max(settings.lengths) > max_pos:
        raise MoendError(f"context {max(settings.lengths)} exceeds the model's max_position_embeddings={max_pos}; "
                         "use shorter --lengths")
    short = [n for n in settings.lengths if n <= settings.warmup + settings.steps]
    if short:
        raise MoendError(f"context {short[0]} is too short for {settings.warmup} warm-up + {settings.steps} "
                         "measured steps; allowed: lengths > warmup + steps")


def _methods(model: Any, settings: DecodeBenchSettings, table: Any, plan: RoutingPlan | None
             ) -> tuple[list[DecodeMethod], str | None]:
    """The methods to run, each MoENDCache method with its plan per context length, and where they came from."""
    methods: list[DecodeMethod] = []
    plan_source = None
    for name in settings.methods:
        moend = name.startswith("moend")
        m = DecodeMethod(name, moend, {"full_inductor": "inductor", "moend_compiled": "moend"}.get(name))
        if moend:
            for n in settings.lengths:
                m.plans[n], plan_source = plan_for_length(model, n, settings, table=table, plan=plan)
        methods.append(m)
    return methods, plan_source


def _run_all(model: Any, methods: list[DecodeMethod], settings: DecodeBenchSettings, table: Any, progress: bool,
             say: Callable[[str], None]) -> list[dict[str, Any]]:
    """One row per (method, context length, batch), in that order; the model is torn down after each method."""
    from tqdm.auto import tqdm

    runs = [(n, b) for n in settings.lengths for b in settings.batches_at(n)]
    bar = tqdm(total=len(methods) * len(runs), desc="bench decode", unit="run", disable=not progress)
    rows: list[dict[str, Any]] = []
    try:
        for m in methods:
            reason = None
            try:
                run.setup_model(model, m, settings, table)
            except Exception as e:  # a missing or broken backend is a result to report, not a crash
                reason = f"setup failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            last_n = None
            for n, b in runs:
                bar.set_postfix_str(f"{m.name} @ {n} x{b}")
                if reason is None:
                    row = _row(model, m, n, b, settings, table, new_length=n != last_n)
                else:
                    row = unavailable_row(m.name, n, reason, b)
                last_n = n
                rows.append(row)
                say(_progress_line(row))
                bar.update(1)
            run.teardown_model(model)
    finally:
        bar.close()
        run.teardown_model(model)
    return rows


def _progress_line(row: dict[str, Any]) -> str:
    where = f"{row['method']} @ {row['tokens']}" + (f" x{row['batch']}" if row["batch"] != 1 else "")
    if row["status"] != "ok":
        return f"{where}: unavailable ({row['reason']})"
    return (f"{where}: {row['ms_median']:.1f} ms/step, {row['tokens_per_s']:.1f} tokens/s, "
            f"cache {format_bytes(row['cache_bytes'])}")


def _row(model: Any, m: DecodeMethod, n: int, batch: int, settings: DecodeBenchSettings, table: Any, *,
         new_length: bool) -> dict[str, Any]:
    """One method at context length ``n`` and ``batch`` rows (random context tokens, seeded per length: the
    first row is the same at every batch size); a failure other than a user error becomes an "unavailable" row
    with the reason."""
    ids = torch.randint(0, model.config.vocab_size, (batch, n - settings.warmup - settings.steps),
                        generator=torch.Generator().manual_seed(settings.seed + n))
    if m.compile_backend == "moend" and new_length:
        # Each length has its own plan (its own bit widths per layer): a served model holds one plan, so each
        # length starts from fresh compiled graphs (compile time is in warmup_s). A new batch size at the same
        # length recompiles once (dynamo then marks the batch dimension dynamic), also in warmup_s.
        torch._dynamo.reset()
    try:
        return run.run_one(model, m, n, settings, ids, table)
    except MoendError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return unavailable_row(m.name, n, f"{type(e).__name__}: {msg[:300]}", batch)


def _meta(model: Any, settings: DecodeBenchSettings, methods: list[DecodeMethod], plan_source: str | None
          ) -> dict[str, Any]:
    from moend_fx.models import model_name

    fp = ModelFingerprint.from_model(model)
    return {
        "model": fp.to_dict(), "model_name": model_name(model), "settings": settings.to_dict(),
        "plan_source": plan_source, "weight_bytes": weight_bytes(model), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
        # per sequence (batch 1); a row of batch B compares against B times these
        "full_cache_16bit": {n: full_cache_bytes(fp, n) for n in settings.lengths},
        "full_cache_model_dtype": {n: full_cache_bytes(fp, n, dtype=None) for n in settings.lengths},
        "planned_bytes": {n: plan_bytes(m.plans[n], n) for m in methods if m.moend for n in settings.lengths},
        "baseline": BASELINE, "memory_cap_bytes": settings.memory_cap_bytes,
        "shape": ModelShape.from_model(model).to_dict(),
        "notes": "ms_median is per decode step (one token for each of the batch's rows); tokens_per_s = batch / "
                 "step seconds; time ratio = baseline ms / method ms at the same length and batch (> 1 is "
                 "faster); cache ratios against the uncompressed cache of the same tokens and rows, 16-bit base "
                 "(the paper's) and the model's dtype; roofline = (weight bytes + cache bytes) / bandwidth",
    }


def add_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Fill the derived columns of every ok row: speedup and time ratio vs the baseline of the same length and
    batch, cache ratios (16-bit and model-dtype bases, for the row's batch), roofline ms and the distance to it,
    tokens/s. Returns ``result`` (rows from before batches existed count as batch 1)."""
    meta = result["meta"]
    bw = meta["settings"]["bandwidth_gbs"] * 1e9
    base = {(r["tokens"], r.get("batch", 1)): r for r in result["rows"]
            if r["method"] == meta.get("baseline", BASELINE) and r["status"] == "ok"}
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        n, batch = r["tokens"], r.setdefault("batch", 1)
        full16 = _lookup(meta["full_cache_16bit"], n) * batch
        fullm = _lookup(meta["full_cache_model_dtype"], n) * batch
        r.setdefault("tokens_per_s", batch / (r["ms_median"] / 1e3))
        r["roofline_ms"] = (meta["weight_bytes"] + r["cache_bytes"]) / bw * 1e3
        r["x_roofline"] = r["ms_median"] / r["roofline_ms"]
        r["cache_ratio_16bit"] = full16 / r["cache_bytes"] if r["cache_bytes"] else None
        r["cache_ratio_model_dtype"] = fullm / r["cache_bytes"] if r["cache_bytes"] else None
        b = base.get((n, batch))
        if b is not None:
            r["speedup_vs_baseline"] = b["ms_median"] / r["ms_median"]
            r["time_ratio_vs_baseline"] = r["ms_median"] / b["ms_median"]
            r["cache_vs_baseline"] = r["cache_bytes"] / b["cache_bytes"] if b["cache_bytes"] else None
            peak, bpeak = r.get("decode_peak_rss_growth"), b.get("decode_peak_rss_growth")
            r["decode_peak_rss_vs_baseline"] = peak / bpeak if peak is not None and bpeak else None
        else:
            r["speedup_vs_baseline"] = r["time_ratio_vs_baseline"] = r["cache_vs_baseline"] = None
            r["decode_peak_rss_vs_baseline"] = None
    return result


def _lookup(d: dict, n: int) -> int:
    # JSON turns int keys into strings
    return d[n] if n in d else d[str(n)]
