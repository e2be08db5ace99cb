"""How many sequences fit under a memory cap: the decode benchmark's batch capacity, predicted from the memory model.

A decode process at context ``n`` and batch ``B`` holds

    weights + cache(n, B) + B * workspace(n)

* ``weights``: the model's parameter and buffer bytes (measured: :func:`moend_fx.bench.probes.weight_bytes`);
* ``cache(n, B)``: the memory model (``moend_fx.plan.memory``): a full cache is
  ``full_cache_bytes(fp, n, B, dtype=None)`` (a ``DynamicCache`` holds every token in the model's dtype); a
  MoENDCache in capacity mode (the default) never holds more than its plan's bytes,
  ``plan_bytes(plan, min(n, plan.context_length), B)`` (:func:`cache_bound`);
* ``workspace(n)``: a *stated* per-sequence transient of one decode step (:func:`workspace_parts`), from the
  model's shapes, not measured: the step's logits, a few hidden-size and MLP activations, one query's attention
  scores over the held tokens, and what the cache materialises for one layer's attention (a ``DynamicCache``'s
  ``torch.cat`` copies a layer's K/V; the eager MoENDCache path dequantizes one layer; the fused ``moend`` op
  reads the packed codes in place).

Not counted: the Python / torch runtime and compiled code (a few hundred MB of RSS before the model loads), the
allocator's slack, the prefill's activations (a long prompt's prefill needs far more than a decode step; chunk
it: ``moend bench prefill``). The largest batch is the largest ``B`` whose total stays within the cap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import dtype_bytes, full_cache_bytes, keep_count, keep_floor, plan_bytes
from moend_fx.plan.routing import ModelFingerprint, RoutingPlan

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_CAP_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_CAP_ALLOWED = ("a size with a unit (e.g. 8GB, 7.5GiB, 8000MB; units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB) or a "
                "number of bytes (e.g. 8e9)")
BASIS = "predicted from the memory model (not measured)"
_MAX_BATCH = 1 << 20


def parse_memory_cap(text: Any) -> int:
    """``"8GB"`` -> 8_000_000_000 bytes (decimal units; ``GiB`` etc. binary); a :class:`MoendError` naming the
    allowed forms otherwise (a ratio like "14x" is a cache budget, not a process cap)."""
    m = _CAP_RE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS | {"": 1}:
        raise MoendError(f"memory cap {text!r} is invalid; allowed: {_CAP_ALLOWED}")
    value = int(float(m.group(1)) * _UNITS.get(unit, 1))
    if value <= 0:
        raise MoendError(f"memory cap {text!r} must be positive; allowed: {_CAP_ALLOWED}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """What the workspace estimate reads of a model: its fingerprint and three sizes of its config."""

    fingerprint: ModelFingerprint
    vocab_size: int
    hidden_size: int
    intermediate_size: int

    @classmethod
    def from_model(cls, model: Any) -> ModelShape:
        cfg = getattr(model.config, "text_config", None) or model.config
        return cls(ModelFingerprint.from_model(model), int(cfg.vocab_size), int(cfg.hidden_size),
                   int(getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size))

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), fingerprint=self.fingerprint.to_dict())


def held_tokens(plan: RoutingPlan | None, tokens: int) -> int:
    """The most tokens any one layer holds at context ``tokens`` (every token for a full cache)."""
    if plan is None:
        return tokens
    t = min(tokens, plan.context_length)
    return max(keep_count(t, c.keep_ratio, keep_floor(plan) if c.evicts else 0) for c in plan.layers)


def workspace_parts(method: str, shape: ModelShape, tokens: int, plan: RoutingPlan | None = None
                    ) -> dict[str, int]:
    """The stated per-sequence transient bytes of one decode step of ``method`` at context ``tokens`` (see the
    module docstring): ``logits`` [V], ``activations`` (4 hidden + 3 MLP vectors), ``scores`` (fp32, every query
    head over the most tokens a layer holds) and ``kv_transient`` (one layer's K/V materialised by the cache)."""
    fp = shape.fingerprint
    eb = dtype_bytes(fp.dtype)
    held = held_tokens(plan, tokens)
    layer_kv = 2 * fp.num_kv_heads * held * fp.head_dim * eb
    transient = {"full_eager": layer_kv, "full_inductor": layer_kv, "moend_eager": layer_kv, "moend_compiled": 0}
    if method not in transient:
        raise MoendError(f"method {method!r} is unknown; allowed: {', '.join(transient)}")
    return {"logits": shape.vocab_size * eb, "activations": (4 * shape.hidden_size + 3 * shape.intermediate_size) * eb,
            "scores": fp.num_heads * held * 4, "kv_transient": transient[method]}


def cache_bound(plan: RoutingPlan | None, fp: ModelFingerprint, tokens: int, batch: int, *,
                calibrated: bool = True) -> int:
    """The memory model's bytes of a cache at context ``tokens`` for ``batch`` rows: the full cache in the model's
    dtype (plan None), or the most a capacity-mode MoENDCache for ``plan`` holds (its plan's bytes at the shorter
    of ``tokens`` and the plan's context length). calibrated: the cache's trig scorer has calibrated stats."""
    if plan is None:
        return full_cache_bytes(fp, tokens, batch, dtype=None)
    return plan_bytes(plan, min(tokens, plan.context_length), batch, calibrated=calibrated)


def largest_batch(cap: int, total: Callable[[int], int]) -> int:
    """The largest ``B >= 0`` with ``total(B) <= cap`` for a ``total`` that grows with ``B`` (0: not even one)."""
    if total(1) > cap:
        return 0
    lo, hi = 1, 2
    while hi <= _MAX_BATCH and total(hi) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # total(lo) <= cap < total(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= cap else (lo, mid)
    return lo


def fit_rows(plans: dict[str, dict[int, RoutingPlan] | None], lengths: tuple[int, ...], shape: ModelShape,
             weights: int, cap: int, *, calibrated: bool = True) -> list[dict[str, Any]]:
    """One row per (method, context length): the largest batch under ``cap`` bytes and what it is made of.
    plans: per method, its MoENDCache plan per length (None for a full-cache method)."""
    fp = shape.fingerprint
    rows = []
    for method, per_length in plans.items():
        for n in lengths:
            plan = None if per_length is None else per_length[n]
            ws = workspace_parts(method, shape, n, plan)

            def total(b: int, plan: RoutingPlan | None = plan, ws_seq: int = sum(ws.values()), n: int = n) -> int:
                return weights + cache_bound(plan, fp, n, b, calibrated=calibrated) + b * ws_seq

            best = largest_batch(cap, total)
            rows.append({"method": method, "tokens": n, "cap_bytes": cap, "weight_bytes": weights,
                         "cache_bytes_per_sequence": cache_bound(plan, fp, n, 1, calibrated=calibrated),
                         "workspace_bytes_per_sequence": sum(ws.values()), "workspace_parts": ws,
                         "largest_batch": best, "bytes_at_largest_batch": total(best) if best else None,
                         "basis": BASIS})
    return rows
