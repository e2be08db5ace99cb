"""``moend_fx.prepare(model, plan)``: make ``model.generate(...)`` use a fresh MoENDCache for the plan.

The hook: generate builds its cache in ``GenerationMixin._prepare_cache_for_generation``. ``prepare``
shadows that method on the *instance* (the class and other models are untouched): when the caller passed
no cache, asked for no ``cache_implementation`` and did not disable caching, it puts a new
:class:`MoENDCache` in ``model_kwargs["cache"]``; otherwise it defers to the original method. It also
sets the attention implementation to "moend". Calling ``prepare`` again replaces the settings;
:func:`unprepare` restores the model.
"""

from __future__ import annotations

import types
from typing import Any

from moend_fx.cache import MoENDCache, _layer_stats  # noqa: F401  (import registers "moend" attention)
from moend_fx.errors import MoendError
from moend_fx.hf_attention import ATTN_NAME
from moend_fx.plan import RoutingPlan
from moend_fx.rope import QueryStats, rope_from_model

_STATE = "_moend_prepared"


def _stats_from_table(table: Any, num_layers: int) -> list[QueryStats | None] | None:
    """Per-layer calibrated QueryStats of a SensitivityTable (None if it has none)."""
    if not table.has_stats():
        return None
    return [table.layer_stats(layer) for layer in range(num_layers)]


def prepare(model: Any, plan: RoutingPlan, *, table: Any = None, **cache_kw: Any) -> Any:
    """Check ``plan`` against ``model``, switch attention to "moend", and make ``model.generate`` build a
    :class:`MoENDCache(plan, rope=rope_from_model(model), query_stats=..., **cache_kw)` per call.

    table: optional SensitivityTable whose calibrated query stats feed the trig scorer.
    cache_kw: MoENDCache options (scorer, evict_every, budget_mode, window, attention_fn, ...).
    Returns the model.
    """
    if not isinstance(plan, RoutingPlan):
        raise MoendError(f"plan must be a RoutingPlan; got {type(plan).__name__}")
    if not hasattr(model, "_prepare_cache_for_generation"):
        raise MoendError(f"model {type(model).__name__} is not a Hugging Face generation model")
    plan.check_model(model)
    if table is not None:
        fp_mismatch = plan.fingerprint.mismatch(table.fingerprint, "plan")
        if fp_mismatch:
            raise MoendError(f"table and plan disagree: {fp_mismatch}")
    kw = dict(cache_kw)
    try:
        kw.setdefault("rope", rope_from_model(model))
    except MoendError:
        if (kw.get("scorer") or plan.scorer) == "trig" and any(c.evicts for c in plan.layers):
            raise
    if table is not None and "query_stats" not in kw:
        kw["query_stats"] = _stats_from_table(table, plan.num_layers)
    MoENDCache(plan, **kw)  # fail now, not inside generate, on bad options

    state = getattr(model, _STATE, None)
    if state is None:
        original = model._prepare_cache_for_generation
        state = {"original": original, "attn": model.config._attn_implementation}

        def _prepare_cache(self: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any):
            st = getattr(self, _STATE)
            if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
                    and generation_config.cache_implementation is None):
                model_kwargs["cache"] = MoENDCache(st["plan"], **st["cache_kw"])
                return None
            return st["original"](generation_config, model_kwargs, *args, **kwargs)

        model._prepare_cache_for_generation = types.MethodType(_prepare_cache, model)
        setattr(model, _STATE, state)
    state["plan"], state["cache_kw"] = plan, kw
    model.set_attn_implementation(ATTN_NAME)
    return model


def unprepare(model: Any) -> Any:
    """Undo :func:`prepare`: the original generate cache and attention implementation."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    del model._prepare_cache_for_generation  # the instance attribute; the class method shows again
    delattr(model, _STATE)
    model.set_attn_implementation(state["attn"])
    return model
