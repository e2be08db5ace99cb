"""Decode benchmark: per-token time and memory of full vs compressed caches, eager vs compiled, in one run.

For each method and context length ``n``: prefill ``n - warmup - steps`` random token ids once (uncompiled
forward, last logits only), then greedy decode ``warmup + steps`` tokens one at a time, so the last step
runs at ``n`` tokens (the model's limit is reachable), and take the median of the last ``steps`` step
times. Methods (``METHODS``):

* ``full_eager``: HF ``DynamicCache``, sdpa attention: the baseline every ratio is taken against;
* ``full_inductor``: the same after ``model.compile()`` (inductor);
* ``moend_eager``: :class:`~moend_fx.cache.moend_cache.MoENDCache` for the plan, reference attention;
* ``moend_compiled``: the same after ``model.compile(backend="moend", options={"plan": ...})``.

A method that fails (e.g. the backend is missing or raises) gives a row with ``status="unavailable"`` and
the reason, and the run goes on. Memory: the cache's own tensor bytes (``nbytes()`` for MoENDCache, K/V
tensor bytes for DynamicCache) and the process RSS growth (peak during prefill, peak during decode, and
retained after decode; glibc keeps freed memory, so RSS figures are upper bounds and noisy). Roofline:
every decode step must read the weights and the whole cache once, so it takes at least
``(weight bytes + cache bytes) / bandwidth`` (design.md: ~27-30 GB/s here).

Compile time shows in ``warmup_s`` (the warm-up steps of the first length pay it). A MoENDCache re-evicts
every 128 generated tokens; with the default 16 steps no re-eviction falls inside the measured window.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moend_fx.bench.decode_report import markdown_table, plot_decode, write_decode
from moend_fx.bench.probes import (
    cache_nbytes,
    peak_rss_bytes,
    release_memory,
    reset_peak_rss,
    rss_bytes,
    weight_bytes,
)
from moend_fx.cache.generation import decode_compile_settings
from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import format_bytes, full_cache_bytes, plan_bytes
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

METHODS: tuple[str, ...] = ("full_eager", "full_inductor", "moend_eager", "moend_compiled")
BASELINE = "full_eager"
DEFAULT_LENGTHS: tuple[int, ...] = (2048, 4096, 8192)
DEFAULT_UNIFORM = LayerConfig(0.25, 4, 4)
DEFAULT_BANDWIDTH_GBS = 28.0  # design.md: ~27-30 GB/s measured on this machine


def all_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class DecodeBenchSettings:
    """What to run. ``budget`` is used only with a table (solved with greedy per context length);
    without a table or plan every layer gets ``uniform``."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    steps: int = 16
    warmup: int = 3
    methods: tuple[str, ...] = METHODS
    budget: str = "14x"
    uniform: LayerConfig = DEFAULT_UNIFORM
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS
    seed: int = 0
    kernel: str = "auto"  # moend backend option
    inner: str = "inductor"  # moend backend option

    def __post_init__(self) -> None:
        for name in ("lengths", "methods"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise MoendError(f"{name} is empty; give at least one")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise MoendError(f"method {bad[0]!r} is unknown; allowed: {', '.join(METHODS)}")
        if len(set(self.methods)) != len(self.methods):
            raise MoendError(f"methods {list(self.methods)} repeat a name; give each once")
        for n in self.lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < 2:
                raise MoendError(f"context length {n!r} is invalid; allowed: an integer >= 2 (tokens)")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise MoendError(f"steps={self.steps!r} is invalid; allowed: an integer >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise MoendError(f"warmup={self.warmup!r} is invalid; allowed: an integer >= 0")
        if not self.bandwidth_gbs > 0:
            raise MoendError(f"bandwidth_gbs={self.bandwidth_gbs!r} is invalid; allowed: a positive number")
        if not isinstance(self.uniform, LayerConfig):
            raise MoendError(f"uniform must be a LayerConfig; got {type(self.uniform).__name__}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["uniform"] = self.uniform.to_dict()
        return d
__all__ = ["METHODS", "DecodeBenchSettings", "add_ratios", "all_cores", "bench_decode", "cache_nbytes",
           "markdown_table", "parse_methods", "plan_for_length", "plan_summary", "plot_decode", "rss_bytes",
           "weight_bytes", "write_decode"]


# --------------------------------------------------------------------------------------------- plans


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
    p = RoutingPlan.uniform(c, fp, length)
    return p, f"hand-written uniform plan: keep {c.keep_ratio:g} / K{c.k_bits} / V{c.v_bits} on every layer"


def plan_summary(plan: RoutingPlan) -> str:
    """``"18x keep 0.25/K4/V4, 12x keep 1/K8/V8"``: how many layers use each config."""
    counts: dict[LayerConfig, int] = {}
    for c in plan.layers:
        counts[c] = counts.get(c, 0) + 1
    parts = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{n}x keep {c.keep_ratio:g}/K{c.k_bits}/V{c.v_bits}" for c, n in parts)


# --------------------------------------------------------------------------------------------- one run


@dataclass
class _Method:
    """How one method builds its cache and sets the model up (and undoes it)."""

    name: str
    moend: bool
    compile_backend: str | None  # None = eager; "inductor" or "moend"
    plans: dict[int, RoutingPlan] = field(default_factory=dict)


def _uncompile(model: Any) -> None:
    # nn.Module.compile stores the compiled call here; clearing it restores plain eager calls.
    if getattr(model, "_compiled_call_impl", None) is not None:
        model._compiled_call_impl = None
    torch._dynamo.reset()


def _setup(model: Any, m: _Method, settings: DecodeBenchSettings, table: Any) -> None:
    from moend_fx.cache.generation import prepare, unprepare

    _uncompile(model)
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
                      options={"plan": first if same else None, "kernel": settings.kernel, "inner": settings.inner})


def _teardown(model: Any) -> None:
    from moend_fx.cache.generation import unprepare

    _uncompile(model)
    unprepare(model)


def _new_cache(model: Any, m: _Method, length: int, table: Any) -> Any:
    if not m.moend:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from moend_fx.cache.generation import _stats_from_table
    from moend_fx.cache.moend_cache import MoENDCache
    from moend_fx.eviction.rope import rope_from_model

    plan = m.plans[length]
    stats = _stats_from_table(table, plan.num_layers) if table is not None else None
    return MoENDCache(plan, rope=rope_from_model(model), query_stats=stats)


@torch.no_grad()
def _run_one(model: Any, m: _Method, length: int, settings: DecodeBenchSettings, ids: torch.Tensor,
             table: Any) -> dict[str, Any]:
    release_memory()
    base_rss = rss_bytes()
    reset_peak_rss()
    cache = _new_cache(model, m, length, table)
    t0 = time.perf_counter()
    # The uncompiled forward for the prefill: nn.Module.compile hooks __call__ only, and a compiled
    # 8k-token prefill graph is not what this benchmark measures.
    out = model.forward(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    tok = out.logits[:, -1:].argmax(-1)
    del out
    prefill_peak = peak_rss_bytes()
    reset_peak_rss()
    # A hand-written decode loop over a MoENDCache does what a prepared model's generate() does: the cache's
    # before_step hook (deferred eviction, dynamic marks) outside the compiled step, under the decode
    # compile settings; a step's time includes the hook.
    before = getattr(cache, "before_step", None) or (lambda: None)
    settings_ctx = decode_compile_settings() if m.compile_backend == "moend" else contextlib.nullcontext()
    with settings_ctx:
        warm0 = time.perf_counter()
        for _ in range(settings.warmup):
            before()
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        warmup_s = time.perf_counter() - warm0
        times = []
        for _ in range(settings.steps):
            t = time.perf_counter()
            before()
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    decode_peak = peak_rss_bytes()
    after = rss_bytes()
    kv, scratch = cache_nbytes(cache)
    held = int(cache.get_seq_length())
    del cache
    release_memory()

    def growth(x: int | None) -> int | None:
        return None if x is None or base_rss is None else x - base_rss

    ms = sorted(t * 1e3 for t in times)
    return {
        "method": m.name, "tokens": length, "status": "ok", "reason": None,
        "ms_median": statistics.median(ms), "ms_min": ms[0], "ms_max": ms[-1], "steps": settings.steps,
        "prefill_s": prefill_s, "warmup_s": warmup_s, "seq_length_after": held,
        "cache_bytes": kv, "scratch_bytes": scratch,
        "rss_base_bytes": base_rss, "prefill_peak_rss_growth": growth(prefill_peak),
        "decode_peak_rss_growth": growth(decode_peak), "rss_retained_growth": growth(after),
        "plan": plan_summary(m.plans[length]) if m.moend else None,
    }


def bench_decode(model: Any, settings: DecodeBenchSettings | None = None, *, table: Any = None,
                 plan: RoutingPlan | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every method at every context length on ``model`` (in eval mode, on CPU); return the result dict
    (``meta`` and ``rows``; see :func:`add_ratios` for the derived columns). Threads: as set by the caller."""
    settings = settings or DecodeBenchSettings()
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
    say = log or (lambda s: None)
    fp = ModelFingerprint.from_model(model)
    methods: list[_Method] = []
    plan_source = None
    for name in settings.methods:
        moend = name.startswith("moend")
        backend = {"full_inductor": "inductor", "moend_compiled": "moend"}.get(name)
        m = _Method(name, moend, backend)
        if moend:
            for n in settings.lengths:
                m.plans[n], plan_source = plan_for_length(model, n, settings, table=table, plan=plan)
        methods.append(m)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(methods) * len(settings.lengths), desc="bench decode", unit="run", disable=not progress)
    rows: list[dict[str, Any]] = []
    try:
        for m in methods:
            reason = None
            try:
                _setup(model, m, settings, table)
            except Exception as e:  # a missing or broken backend is a result to report, not a crash
                reason = f"setup failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            for n in settings.lengths:
                bar.set_postfix_str(f"{m.name} @ {n}")
                if reason is None:
                    ids = torch.randint(0, model.config.vocab_size, (1, n - settings.warmup - settings.steps),
                                        generator=torch.Generator().manual_seed(settings.seed + n))
                    if m.compile_backend == "moend":
                        # Each length has its own plan (its own bit widths per layer): a served model holds one
                        # plan, so each length starts from fresh compiled graphs (compile time is in warmup_s).
                        torch._dynamo.reset()
                    try:
                        row = _run_one(model, m, n, settings, ids, table)
                    except MoendError:
                        raise
                    except Exception as e:
                        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        row = _unavailable(m.name, n, f"{type(e).__name__}: {msg[:300]}")
                else:
                    row = _unavailable(m.name, n, reason)
                rows.append(row)
                if row["status"] == "ok":
                    say(f"{m.name} @ {n}: {row['ms_median']:.1f} ms/token, cache {format_bytes(row['cache_bytes'])}")
                else:
                    say(f"{m.name} @ {n}: unavailable ({row['reason']})")
                bar.update(1)
            _teardown(model)
    finally:
        bar.close()
        _teardown(model)

    wb = weight_bytes(model)
    meta = {
        "model": fp.to_dict(), "model_name": _model_name(model), "settings": settings.to_dict(),
        "plan_source": plan_source, "weight_bytes": wb, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
        "full_cache_16bit": {n: full_cache_bytes(fp, n) for n in settings.lengths},
        "full_cache_model_dtype": {n: full_cache_bytes(fp, n, dtype=None) for n in settings.lengths},
        "planned_bytes": {n: plan_bytes(m.plans[n], n) for m in methods if m.moend for n in settings.lengths},
        "baseline": BASELINE,
        "notes": "time ratio = baseline ms / method ms (> 1 is faster); cache ratios against the uncompressed "
                 "cache of the same tokens, 16-bit base (the paper's) and the model's dtype; roofline = "
                 "(weight bytes + cache bytes) / bandwidth",
    }
    result = {"format": "moend_fx.bench.decode", "version": 1, "meta": meta, "rows": rows}
    return add_ratios(result)


def _model_name(model: Any) -> str:
    from moend_fx.models import model_name

    return model_name(model)


def _unavailable(method: str, tokens: int, reason: str) -> dict[str, Any]:
    return {"method": method, "tokens": tokens, "status": "unavailable", "reason": reason}


def add_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Fill the derived columns of every ok row: speedup and time ratio vs the baseline of the same length,
    cache ratios (16-bit and model-dtype bases), roofline ms and the distance to it. Returns ``result``."""
    meta = result["meta"]
    bw = meta["settings"]["bandwidth_gbs"] * 1e9
    base = {r["tokens"]: r for r in result["rows"] if r["method"] == meta.get("baseline", BASELINE)
            and r["status"] == "ok"}
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        n = r["tokens"]
        full16 = _lookup(meta["full_cache_16bit"], n)
        fullm = _lookup(meta["full_cache_model_dtype"], n)
        r["roofline_ms"] = (meta["weight_bytes"] + r["cache_bytes"]) / bw * 1e3
        r["x_roofline"] = r["ms_median"] / r["roofline_ms"]
        r["cache_ratio_16bit"] = full16 / r["cache_bytes"] if r["cache_bytes"] else None
        r["cache_ratio_model_dtype"] = fullm / r["cache_bytes"] if r["cache_bytes"] else None
        b = base.get(n)
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


def parse_methods(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"full_eager,moend_eager"`` or ``"all"`` -> a checked tuple of method names."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if items == ["all"]:
        return METHODS
    bad = [m for m in items if m not in METHODS]
    if bad or not items:
        raise MoendError(f"methods {text!r} are invalid; allowed: 'all' or a comma list of {', '.join(METHODS)}")
    return tuple(items)
