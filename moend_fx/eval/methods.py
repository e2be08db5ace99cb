"""The methods an evaluation compares, and how each turns one full-precision prefill into its own cache.

Every example is prefilled once at full precision (SDPA); :class:`PrefillState` keeps that prefill's K/V
(per layer [B, Hkv, T, D], post-RoPE; every layer's T tokens, sliding-window layers included) and the last ``W``
post-RoPE queries of each layer (for scorers that estimate query statistics). Each method then builds its cache from
the *same* state:

* ``full``: a ``DynamicCache`` holding the K/V as they are (the model's dtype); built from the model's config, so
  on a sliding-window hybrid each sliding layer keeps its last ``window - 1`` tokens, as after a plain prefill (the
  cache a user holds, whose 16-bit size is the ratio base: ``moend_fx.plan.memory.full_cache_bytes``).
* ``hf_quant4`` / ``hf_fp8``: transformers' ``QuantizedCache`` (quanto 4-bit, group 64; fp8 per tensor),
  fed the prefill K/V exactly as its own ``update`` would be during a prefill. ``hf_quant4`` needs
  optimum-quanto; when it is absent the method is reported unavailable (never silently dropped).
* ``1d``, ``2d_uniform``, ``2d``, ``pyramid``, ``2d_hetero`` (greedy), ``2d_hetero_exact`` (exact),
  ``2d_hetero_anyk`` (greedy without the solvers' last-resort rule for 4-bit keys; a diagnosis, not in the
  default list) and ``lossless``: a :class:`~moend_fx.cache.moend_cache.MoENDCache` whose plan comes from the
  solver of the same family on the calibrated table, solved for the example's own context length
  (:class:`~moend_fx.eval.plan_book.PlanBook` caches plans per (method, budget, length)).
  ``2d_uniform_matched`` is ``2d_uniform``'s plan with its keep ratio raised until it spends the budget (off
  the grid; uniform at matched bytes).

The state tensors are never modified: every cache update in transformers and in ``PackedKV`` concatenates
into new tensors, so handing the same tensors to several caches is a copy-free "copy" of the prefill.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.tables import layer_query_stats
from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import rope_from_model
from moend_fx.plan.routing import ModelFingerprint, RoutingPlan


@dataclass(frozen=True)
class MethodSpec:
    """One row family of the results table.

    kind: "full" (DynamicCache), "hf" (transformers QuantizedCache) or "moend" (MoENDCache + solver plan).
    solver / solver_options: the plan's solver (moend only). budgeted: runs once per budget (else once).
    cache_options: MoENDCache options this method overrides (moend only). matched_keep: the solver's uniform
    plan gets the largest keep ratio that fits the budget (:func:`~moend_fx.solvers.matched_keep.fill_keep`).
    """

    name: str
    kind: str
    description: str
    solver: str | None = None
    solver_options: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    hf_options: dict[str, Any] = field(default_factory=dict)
    cache_options: dict[str, Any] = field(default_factory=dict)
    matched_keep: bool = False

    @property
    def budgeted(self) -> bool:
        return self.kind == "moend" and self.name != "lossless"


METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("full", "full", "uncompressed DynamicCache (model dtype)"),
    MethodSpec("hf_quant4", "hf", "transformers QuantizedCache, quanto 4-bit, group 64, residual 128",
               backend="quanto", hf_options=dict(nbits=4, q_group_size=64, residual_length=128)),
    MethodSpec("hf_fp8", "hf", "transformers QuantizedCache, fp8 e4m3 per tensor (no extra package)",
               backend="fp8"),
    # the sanity row keeps every token it is given: no byte budget to hold (capacity mode would start evicting
    # at the first generated token of a plan solved for exactly the prompt)
    MethodSpec("lossless", "moend", "MoENDCache, keep 1.0 and 16/16 bits on every layer (sanity row)",
               cache_options=dict(budget_mode="ratio")),
    MethodSpec("1d", "moend", "uniform eviction, 16/16 bits (best keep ratio that fits)", solver="1d"),
    MethodSpec("2d_uniform", "moend", "uniform eviction + uniform K/V bits (best pair that fits)",
               solver="2d_uniform"),
    # 2d_uniform's grid plan can hold far less than its budget (17x at "14x"): this one spends it, so that a
    # comparison at matched bytes has a uniform baseline that holds what MoE-nD holds
    MethodSpec("2d_uniform_matched", "moend", "2d_uniform's bits with the largest uniform keep ratio that fits "
               "(uniform at matched bytes)", solver="2d_uniform", matched_keep=True),
    MethodSpec("2d", "moend", "uniform eviction, per-layer bits (exact over bits)", solver="2d"),
    MethodSpec("pyramid", "moend", "PyramidKV-style linear keep schedule, best uniform bit pair",
               solver="pyramid"),
    MethodSpec("2d_hetero", "moend", "MoE-nD: per-layer eviction and bits, greedy plan", solver="greedy"),
    MethodSpec("2d_hetero_exact", "moend", "MoE-nD: per-layer eviction and bits, exact plan", solver="exact"),
    # a diagnosis of the solvers' default, not a method of the paper: what the last-resort rule costs or buys
    MethodSpec("2d_hetero_anyk", "moend", "MoE-nD greedy plan with 4-bit keys at any keep ratio (the solvers' "
               "last-resort rule off)", solver="greedy", solver_options=dict(narrow_k_min_keep=0.0)),
)}

DEFAULT_METHODS = ("full", "hf_quant4", "hf_fp8", "1d", "2d_uniform", "2d", "pyramid", "2d_hetero",
                   "2d_hetero_exact")


def method_runs(names: Sequence[str], budgets: Sequence[str]) -> Iterator[tuple[MethodSpec, str | None]]:
    """(spec, budget) of every run of methods ``names``: a budgeted method once per budget, the others once
    (budget None)."""
    for name in names:
        spec = METHODS[name]
        for budget in (budgets if spec.budgeted else (None,)):
            yield spec, budget


def hf_backend_available(backend: str) -> bool:
    """Whether transformers can build a QuantizedCache with ``backend`` in this environment."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    return {"quanto": is_optimum_quanto_available, "hqq": is_hqq_available}.get(backend, lambda: True)()


def unavailable_reason(name: str, model: Any = None) -> str | None:
    """Why method ``name`` cannot run here, or on ``model`` when given (None if it can)."""
    spec = METHODS[name]
    sliding = 0 if model is None or spec.kind != "hf" else len(ModelFingerprint.from_model(model).sliding)
    if sliding:
        return (f"{name} is transformers' QuantizedCache, which serves only full-attention models; this model has "
                f"{sliding} sliding-window layer(s)")
    if spec.kind == "hf" and not hf_backend_available(spec.backend):
        return (f"{name} needs the '{spec.backend}' backend of transformers' QuantizedCache "
                f"(package optimum-quanto), which is not installed in this environment")
    return None


def check_methods(names: Sequence[str], *, skip_unavailable: bool = True, model: Any = None,
                  ) -> tuple[list[str], dict[str, str]]:
    """(runnable method names, {skipped name: reason}), on ``model`` when given. Unknown names raise MoendError."""
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise MoendError(f"method {bad[0]!r} is unknown; allowed: {', '.join(METHODS)}")
    if not names:
        raise MoendError(f"no methods given; allowed: {', '.join(METHODS)}")
    run, skipped = [], {}
    for n in dict.fromkeys(names):
        why = unavailable_reason(n, model)
        if why is None:
            run.append(n)
        elif skip_unavailable:
            skipped[n] = why
        else:
            raise MoendError(why)
    return run, skipped


# --------------------------------------------------------------------------------------------- prefill state


@dataclass
class PrefillState:
    """A full-precision prefill: kv[l] = (K, V) [B, Hkv, T, D] post-RoPE; queries[l] = [B, H, W, D] post-RoPE
    (the last W queries of layer l, W <= window); length = T."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    queries: list[torch.Tensor | None]
    length: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.kv for t in kv)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable in ``obj`` (tensors, tensor subclasses such as quanto's, tuples,
    lists, dicts). A tensor subclass is measured through its inner tensors (``__tensor_flatten__``)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = flatten()
            return sum(tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


_LAYER_FIELDS = ("keys", "values", "_quantized_keys", "_quantized_values")


def cache_nbytes(cache: Any) -> int:
    """Measured bytes of a cache's stored K/V: MoENDCache via its own ``nbytes()``; HF caches by walking the
    stored tensors of every layer (residual windows included)."""
    if isinstance(cache, MoENDCache):
        return cache.nbytes().total
    return sum(tensor_bytes(getattr(layer, f, None)) for layer in cache.layers for f in _LAYER_FIELDS)


# --------------------------------------------------------------------------------------------- caches


def moend_options(model: Any, table: SensitivityTable, *, window: int, calibrated_stats: bool = True,
                  **extra: Any) -> dict[str, Any]:
    """MoENDCache options for every MoENDCache method of a run: the model's RoPE (None when it has no readable
    rotary embedding), the table's calibrated query statistics (unless ``calibrated_stats`` is False: then
    scorers estimate them from the ``window`` last queries) and ``extra`` (``evict_every``, ``scorer``...)."""
    try:
        rope = rope_from_model(model)
    except MoendError:
        rope = None
    stats = layer_query_stats(table) if calibrated_stats else None
    return dict(rope=rope, query_stats=stats, window=window, **extra)


def moend_from_prefill(plan: RoutingPlan, state: PrefillState, **cache_kw: Any) -> MoENDCache:
    """A MoENDCache holding ``state`` compressed by ``plan``, as if the prefill had run through it
    (:meth:`MoENDCache.from_prefill` on the state's K/V and recorded query windows).
    cache_kw: MoENDCache options (rope, query_stats, window, scorer, ...).
    """
    return MoENDCache.from_prefill(plan, state.kv, state.queries, **cache_kw)


def build_cache(spec: MethodSpec, state: PrefillState, *, model: Any, plan: RoutingPlan | None = None,
                **moend_kw: Any) -> Any:
    """The cache of method ``spec`` holding ``state`` (compressed as the method prescribes)."""
    from transformers import DynamicCache, QuantizedCache

    if spec.kind == "moend":
        if plan is None:
            raise MoendError(f"method {spec.name} needs a plan")
        return moend_from_prefill(plan, state, **{**moend_kw, **spec.cache_options})
    if spec.kind == "full":
        cache = DynamicCache(config=model.config)
    elif spec.kind == "hf":
        cache = QuantizedCache(spec.backend, model.config, **spec.hf_options)
    else:
        raise MoendError(f"method kind {spec.kind!r} is unknown; allowed: full, hf, moend")
    for layer, (k, v) in zip(cache.layers, state.kv):
        layer.update(k, v)
    return cache
