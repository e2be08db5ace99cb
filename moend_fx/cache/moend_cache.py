"""MoENDCache: a Hugging Face ``Cache`` of heterogeneous compressed layers, one per transformer layer.

Each layer (:class:`moend_fx.cache.layer.MoENDLayer`) stores its own kept tokens, K/V bit widths and
original positions in a :class:`moend_fx.storage.packed.PackedKV`. Attention over it is computed by the "moend"
attention function (``moend_fx.cache.hf_attention``, registered on import of this module), so::

    model.set_attn_implementation("moend")
    model.generate(ids, cache=MoENDCache(plan, rope=rope_from_model(model)))

or simply ``moend_fx.prepare(model, plan)`` then ``model.generate(ids)``. See ``docs/cache.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache

import moend_fx.cache.hf_attention  # noqa: F401  (registers the "moend" attention function)
from moend_fx.cache.layer import MoENDLayer, PackedAttention
from moend_fx.cache.sliding import sliding_layer
from moend_fx.common.checks import check_choice
from moend_fx.common.defaults import EVICT_EVERY, QUERY_WINDOW
from moend_fx.common.errors import MoendError
from moend_fx.common.options import BudgetMode, ReEviction
from moend_fx.eviction.capacity import LayerBudget
from moend_fx.eviction.policy import EvictionPolicy
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers import Scorer, build_scorer
from moend_fx.plan.memory import keep_floor
from moend_fx.plan.routing import LayerConfig, RoutingPlan


class CacheBytes(NamedTuple):
    """Measured bytes: ``per_layer`` (one int per layer) and their ``total``."""

    per_layer: list[int]
    total: int


def _layer_stats(query_stats: Any, layer: int) -> QueryStats | None:
    """Calibrated query stats of one layer from a list/tuple or a {layer: QueryStats} mapping (or None)."""
    if query_stats is None:
        return None
    if isinstance(query_stats, Mapping):
        stats = query_stats.get(layer, query_stats.get(str(layer)))
    elif isinstance(query_stats, Sequence):
        stats = query_stats[layer] if layer < len(query_stats) else None
    else:
        raise MoendError(f"query_stats must be a list or a {{layer: QueryStats}} dict; got {type(query_stats)}")
    if stats is not None and not isinstance(stats, QueryStats):
        raise MoendError(f"query_stats[{layer}] must be a QueryStats; got {type(stats).__name__}")
    return stats


def _layer_budget(plan: RoutingPlan, config: LayerConfig, scorer: Scorer | None, name: str | Scorer,
                  window: int) -> LayerBudget:
    """The memory model of one layer of ``plan``: its scorer's, or for a layer that keeps every token, that of the
    uncalibrated scorer ``name`` it would start evicting with."""
    fp = plan.fingerprint
    scorer_name = str(scorer.name if scorer is not None else getattr(name, "name", name))
    calibrated = scorer is not None and scorer.calibrated
    return LayerBudget(config, plan.context_length, fp.num_kv_heads, fp.num_heads, fp.head_dim, plan.group_size,
                       keep_floor(plan), window, scorer_name, calibrated)


class MoENDCache(Cache):
    """Compressed KV cache for one :class:`RoutingPlan` (one :class:`MoENDLayer` per model layer).

    plan: per-layer (keep_ratio, k_bits, v_bits), group size, scorer name, sinks / recent tokens.
    scorer: overrides ``plan.scorer`` (a name or a :class:`Scorer` used on every layer).
    rope: the model's RoPE (needed by ``trig``); query_stats: calibrated per-layer :class:`QueryStats`
    (list or ``{layer: stats}``); without them ``trig`` estimates them from the last ``window`` queries.
    budget_mode: "capacity" (default: no layer ever holds more bytes than the plan gives it at
    ``plan.context_length``, :meth:`budget_bytes`, whatever the length; a layer that keeps every token starts
    evicting when it outgrows that) or "ratio" (keep_ratio of the tokens seen, re-evicted every ``evict_every``
    decode steps, growing in between: the plan's bytes hold right after an eviction only). See docs/cache.md.
    reserve: capacity mode, tokens of headroom each layer keeps beyond the next (a speculative verify step of up to
    ``reserve + 1`` tokens then fits without evicting early: ``moend_fx.cache.speculation``; default 0).
    reevict: what a decode-time re-eviction drops from a packed layer: whole packed ``"groups"`` (default; kept
    codes are never re-quantized) or single ``"tokens"`` (the lowest-ranked; survivors re-quantized).
    An evicting layer never keeps fewer than ``floor = plan.sink_tokens + plan.recent_tokens`` tokens (or all it
    has, when fewer): ``keep_count(T, keep_ratio, floor)``, which the memory model (``plan_bytes``) uses too.
    attention_fn: attention over a PackedKV (default :func:`moend_fx.attention.fused.fused_layer_attention`: the
    fused op for a decode step over a quantized layer eager, else
    :func:`moend_fx.attention.packed.packed_layer_attention`, SDPA over the dequantized layer, the pattern the
    ``moend`` backend fuses under compile; pass ``packed_layer_attention`` for plain torch ops eager, or
    :func:`moend_fx.attention.reference.reference_attention` for the fp32 oracle), the one function a fused
    backend swaps.

    :meth:`from_prefill` builds the cache a prefill through the "moend" attention would leave from a
    full-precision prefill's K/V (and its last queries) without recomputing attention.
    """

    def __init__(
        self, plan: RoutingPlan, *, scorer: str | Scorer | None = None, rope: RopeSpec | None = None,
        query_stats: Any = None, evict_every: int = EVICT_EVERY, budget_mode: str = BudgetMode.CAPACITY,
        window: int = QUERY_WINDOW, attention_fn: PackedAttention | None = None,
        scorer_kwargs: dict[str, Any] | None = None, reevict: str = ReEviction.GROUPS, reserve: int = 0,
    ) -> None:
        if not isinstance(plan, RoutingPlan):
            raise MoendError(f"plan must be a RoutingPlan; got {type(plan).__name__}")
        budget_mode = check_choice("budget_mode", budget_mode, BudgetMode)
        if rope is not None and rope.head_dim != plan.fingerprint.head_dim:
            raise MoendError(f"rope head_dim {rope.head_dim} != the plan's head_dim {plan.fingerprint.head_dim}")
        self.plan = plan
        self.budget_mode = budget_mode
        name = plan.scorer if scorer is None else scorer
        layers = []
        for i, cfg in enumerate(plan.layers):
            if plan.fingerprint.is_sliding(i):  # its oldest tokens leave as new ones arrive: moend_fx.cache.sliding
                layers.append(sliding_layer(plan, i, budget_mode=budget_mode, attention_fn=attention_fn))
                continue
            policy = EvictionPolicy(budget_mode, evict_every, window, plan.sink_tokens, plan.recent_tokens, reevict,
                                    reserve)
            sc = spare = None
            if cfg.evicts:
                sc = build_scorer(name, rope=rope, stats=_layer_stats(query_stats, i), query_window=window,
                                  **(scorer_kwargs or {}))
            elif policy.capped:
                # built when the layer outgrows its byte budget and starts evicting; without calibrated
                # statistics, whose bytes the plan did not budget: it scores from the queries it sees from then on
                spare = functools.partial(build_scorer, name, rope=rope, stats=None, query_window=window,
                                          **(scorer_kwargs or {}))
            layers.append(MoENDLayer(
                cfg, layer_idx=i, group_size=plan.group_size, scorer=sc, policy=policy, attention_fn=attention_fn,
                budget=_layer_budget(plan, cfg, sc, name, window), spare=spare))
        super().__init__(layers=layers)

    @classmethod
    def from_prefill(
        cls, plan: RoutingPlan, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        queries: Sequence[torch.Tensor | None] | None = None, **cache_kw: Any,
    ) -> MoENDCache:
        """The cache a prefill of the same tokens through the "moend" attention function would leave, built from
        a full-precision prefill without recomputing attention: each layer evicts with its own scorer, sinks and
        recent window, then quantizes (:meth:`MoENDLayer.load_prefill`).

        kv: one (keys, values) per layer, each [B, Hkv, T, D] post-RoPE (what a ``DynamicCache`` holds after
        the prefill: ``[(layer.keys, layer.values) for layer in dynamic_cache.layers]``, or that cache itself);
        unpadded rows.
        queries: None, or one entry per layer: [B, H, W, D] post-RoPE queries of the last W prompt tokens (the
        scorer's observation window; W >= min(T, window) for the same window as a real prefill) or None for
        no queries (a scorer that needs them then raises a MoendError).
        cache_kw: the constructor's options (rope, query_stats, window, evict_every, scorer, budget_mode, ...).
        The tensors are not modified (the cache quantizes into new storage).
        """
        cache = cls(plan, **cache_kw)
        n = len(cache.layers)
        if isinstance(kv, Cache) and not isinstance(kv, MoENDCache):
            kv = [(layer.keys, layer.values) for layer in kv.layers]  # e.g. the DynamicCache of the prefill
        if isinstance(kv, (str, bytes)) or not isinstance(kv, Sequence) or len(kv) != n:
            got = f"{len(kv)} entries" if isinstance(kv, Sequence) else type(kv).__name__
            raise MoendError(f"kv must hold one (keys, values) per layer: the plan has {n} layers; got {got}")
        if queries is None:
            queries = [None] * n
        elif isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence) or len(queries) != n:
            got = f"{len(queries)} entries" if isinstance(queries, Sequence) else type(queries).__name__
            raise MoendError(f"queries must be None or hold one tensor (or None) per layer: the plan has {n} "
                             f"layers; got {got}")
        fp = plan.fingerprint
        shape0 = None
        for i, (entry, q) in enumerate(zip(kv, queries)):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise MoendError(f"kv[{i}] must be a (keys, values) pair; got {type(entry).__name__}")
            k, v = entry
            for name, t in (("keys", k), ("values", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != fp.num_kv_heads \
                        or t.shape[3] != fp.head_dim:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise MoendError(
                        f"kv[{i}] {name} {got} must be [B, Hkv={fp.num_kv_heads}, T, D={fp.head_dim}] (the plan's "
                        f"model: {fp.architecture}); was the prefill run on another model?"
                    )
            shape0 = shape0 or (k.shape[0], k.shape[2])
            if (k.shape[0], k.shape[2]) != shape0:
                raise MoendError(f"kv[{i}] keys {tuple(k.shape)}: every layer must hold the same batch and tokens "
                                 f"as layer 0 (B={shape0[0]}, T={shape0[1]})")
            if q is not None and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != fp.num_heads:
                raise MoendError(f"queries[{i}] {tuple(q.shape)} must be [B, H={fp.num_heads}, W, D={fp.head_dim}] "
                                 "(the plan's model's query heads)")
            cache.layers[i].load_prefill(k, v, q)
        return cache

    def before_step(self) -> None:
        """Call outside the compiled region before each forward of a compiled model (``moend_fx.prepare``
        does it for ``generate``): finishes the previous decode step's deferred eviction and marks the cache
        tensors' token axis dynamic. Harmless for eager use.

        Capacity mode: once one keep-1.0 layer has started evicting (it outgrew its cap), every other one starts
        too (its storage gains positions), so a compiled decode graph changes once, not once per layer."""
        self.settle()
        if any(layer.evictor.evicting and not layer.config.evicts for layer in self.layers):
            for layer in self.layers:
                layer.start_evicting()
        for layer in self.layers:
            layer.before_step()

    def settle(self) -> None:
        """Finish any decode step whose eviction a compiled graph deferred (the readers below call it)."""
        for layer in self.layers:
            layer.settle()

    def held_tokens(self) -> list[int]:
        """Tokens each layer stores per (batch row, KV head)."""
        self.settle()
        return [layer.held for layer in self.layers]

    def nbytes(self) -> CacheBytes:
        """Measured bytes of every stored tensor, per layer and in total (equals :meth:`model_bytes`)."""
        self.settle()
        per = [layer.nbytes() for layer in self.layers]
        return CacheBytes(per, sum(per))

    def model_bytes(self) -> CacheBytes:
        """What the memory model says the held tokens take (``moend_fx.plan.memory.layer_bytes``) plus the eviction
        state (``moend_fx.plan.scorer_state.scorer_state_bytes``), through each layer's ``LayerBudget``."""
        per = [layer.model_nbytes() for layer in self.layers]
        return CacheBytes(per, sum(per))

    def budget_bytes(self, batch: int = 1) -> CacheBytes:
        """The bytes each layer may hold in capacity mode (its plan's bytes at ``plan.context_length`` for
        ``batch`` rows, in the plan's model dtype): what :meth:`nbytes` never exceeds in that mode."""
        dtype = self.plan.fingerprint.dtype
        per = [layer.budget.cap(batch=batch, dtype=dtype) for layer in self.layers]
        return CacheBytes(per, sum(per))

    def state_nbytes(self) -> int:
        """Of :meth:`nbytes`, the bytes of the eviction state (query windows, RoPE offsets, scorer statistics)."""
        return sum(layer.state_nbytes() for layer in self.layers)
