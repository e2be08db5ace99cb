"""``moend_fx.prepare(model, plan)``: make ``model.generate(...)`` use a fresh MoENDCache for the plan.

The hook: generate builds its cache in ``GenerationMixin._prepare_cache_for_generation``. ``prepare``
shadows that method on the *instance* (the class and other models are untouched): when the caller passed
no cache, asked for no ``cache_implementation`` and did not disable caching, it puts a new
:class:`MoENDCache` in ``model_kwargs["cache"]``; otherwise it defers to the original method. It also
sets the attention implementation to "moend". Calling ``prepare`` again replaces the settings;
:func:`unprepare` restores the model.

Long prompts: ``_prefill`` is shadowed too. A prompt longer than ``prefill_chunk_above`` tokens going into a
:class:`MoENDCache` is prefilled in chunks of ``prefill_chunk`` tokens (HF's own chunked prefill, by setting
``generation_config.prefill_chunk_size`` for that call unless the caller set it): the first chunk takes the
staged prefill path (SDPA, evict, compress), each later one is appended to the compressed past, attends to it and
re-evicts (``MoENDLayer.update`` / ``attend``). The prefill's transient memory is then one chunk's activations
and full-precision K/V, not the whole prompt's (docs/cache.md, "Long prompts in bounded memory").

For a compiled model (``model.compile(backend="moend")``) two more instance methods are shadowed:

* ``prepare_inputs_for_generation`` first calls :meth:`MoENDCache.before_step` on the generate cache, outside
  the compiled region: the previous decode step's deferred eviction runs there, and the cache tensors' token
  axis is marked dynamic (no recompile per cache size);
* ``_prefill`` runs under ``torch.compiler.set_stance("force_eager")`` (unless ``compile_prefill=True``): the
  prompt's SDPA + eviction + compression is eager code with data-dependent sizes, and a prompt-length graph
  would be used once. Only decode steps run the compiled graph, so ``fullgraph=True`` holds for them;
* ``generate`` runs under :func:`decode_compile_settings`, so the decode graph is traced with the cache's
  logical length as a symbolic int and without 0/1 specialisation of the cache sizes: two decode graphs
  (a step that flushes a group of G tokens into packed codes, and one that does not) serve every step.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from moend_fx.cache.hf_attention import ATTN_NAME
from moend_fx.cache.layer_handoff import install_handoff, remove_handoff
from moend_fx.cache.moend_cache import MoENDCache  # (import registers "moend" attention)
from moend_fx.cache.pricing import check_priced
from moend_fx.cache.speculation import eager_if_assisted, shadow_candidates
from moend_fx.calibration.tables import layer_query_stats
from moend_fx.common.defaults import PREFILL_CHUNK, PREFILL_CHUNK_ABOVE
from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import rope_from_model
from moend_fx.plan.families import check_family
from moend_fx.plan.routing import RoutingPlan

_STATE = "_moend_prepared"
# The cache layers' logical length (an int attribute read by the mask and position code of the decode step).
_DYNAMIC_INTS = r".*\.layers\[\d+\]\.logical$"


@contextlib.contextmanager
def decode_compile_settings() -> Iterator[None]:
    """Compiler settings under which a compiled decode step over a :class:`MoENDCache` needs no recompile as the
    cache grows (measured: 2 graphs over 200 decode steps instead of 7; ``docs/compile.md``):

    * ``torch.compiler.config.dynamic_sources`` gets the layers' ``logical`` length: symbolic from the first
      decode graph (else the first graph is specialised to the prompt length and recompiled at step 2);
    * ``backed_size_oblivious``: cache sizes marked dynamic (``MoENDCache.before_step``) are not specialised at
      0 or 1 (an empty residual window right after a flush, a first packed group).

    Prepared models' ``generate`` runs under it; use it yourself around a hand-written decode loop.
    """
    import torch.fx.experimental._config as fx_config

    sources = torch.compiler.config.dynamic_sources
    sources = f"{sources},{_DYNAMIC_INTS}" if sources else _DYNAMIC_INTS
    with torch.compiler.config.patch(dynamic_sources=sources), fx_config.patch(backed_size_oblivious=True):
        yield


def _find_cache(args: tuple, kwargs: dict) -> MoENDCache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        cache = next((a for a in args if isinstance(a, MoENDCache)), None)
    return cache if isinstance(cache, MoENDCache) else None


def prepare(model: Any, plan: RoutingPlan, *, table: Any = None, compile_prefill: bool = False,
            prefill_chunk: int | None = PREFILL_CHUNK, prefill_chunk_above: int = PREFILL_CHUNK_ABOVE,
            **cache_kw: Any) -> Any:
    """Check ``plan`` against ``model``, switch attention to "moend", and make ``model.generate`` build a
    :class:`MoENDCache(plan, rope=rope_from_model(model), query_stats=..., **cache_kw)` per call.

    table: optional SensitivityTable whose calibrated query stats feed the trig scorer.
    compile_prefill: run the prefill through a compiled forward too (default False: eager prefill, compiled
    decode steps; see the module docstring).
    prefill_chunk: a prompt longer than ``prefill_chunk_above`` tokens is prefilled in chunks of this many tokens,
    each compressed before the next is fed, so the prefill's peak memory is the weights, the compressed cache and
    one chunk's activations and full-precision K/V (default 2048 above 4096 tokens; docs/cache.md says why and
    what it costs). None or 0: one pass whatever the length. A ``prefill_chunk_size`` the caller gives
    ``generate`` (or sets in the model's generation config) wins; only MoENDCache prefills are chunked.
    cache_kw: MoENDCache options (scorer, evict_every, budget_mode, window, attention_fn, ...).
    Returns the model. A cache these options would build that can hold more than the plan's budget (another
    eviction state than the plan was priced for: no ``table=``, another ``scorer=``, a larger ``window=``) is a
    BudgetError naming the option and how to re-solve (:func:`moend_fx.cache.pricing.check_priced`).
    """
    if not isinstance(plan, RoutingPlan):
        raise MoendError(f"plan must be a RoutingPlan; got {type(plan).__name__}")
    if not isinstance(compile_prefill, bool):
        raise MoendError(f"compile_prefill={compile_prefill!r} is invalid; allowed: True or False")
    chunk, above = check_prefill_chunk(prefill_chunk, prefill_chunk_above)
    if not hasattr(model, "_prepare_cache_for_generation") or not hasattr(model, "_prefill"):
        raise MoendError(f"model {type(model).__name__} is not a Hugging Face generation model")
    check_family(model)  # one clear error for a family moend_fx cannot serve (moend_fx.plan.families)
    plan.check_model(model)
    kw = _cache_options(model, plan, table, cache_kw)
    # fail now, not inside generate, on bad options or on a cache that would not keep the plan's budget
    check_priced(plan, MoENDCache(plan, **kw), cache_kw, table)
    state = getattr(model, _STATE, None) or _install(model)
    state["plan"], state["cache_kw"], state["compile_prefill"] = plan, kw, compile_prefill
    state["prefill_chunk"], state["prefill_chunk_above"] = chunk, above
    model.moend_plan = plan
    model.set_attn_implementation(ATTN_NAME)
    return model


def check_prefill_chunk(chunk: Any, above: Any) -> tuple[int, int]:
    """``(chunk, above)`` as ints (chunk 0 = never chunk), or a MoendError naming the bad value.

    A chunk of one token would be fed as decode steps (the cache re-evicts per chunk only for chunks of two or
    more tokens), so the smallest chunk is 2."""
    is_int = isinstance(chunk, int) and not isinstance(chunk, bool)
    if chunk is None or (is_int and chunk == 0):
        chunk = 0
    elif not is_int or chunk < 2:
        raise MoendError(f"prefill_chunk={chunk!r} is invalid; allowed: None or 0 (prefill in one pass) or an "
                         "int >= 2 (tokens per prefill chunk)")
    if isinstance(above, bool) or not isinstance(above, int) or above < 0:
        raise MoendError(f"prefill_chunk_above={above!r} is invalid; allowed: an int >= 0 (prompts longer than "
                         "this many tokens are prefilled in chunks)")
    return chunk, above


def _auto_chunk(state: dict[str, Any], input_ids: torch.Tensor, generation_config: Any,
                model_kwargs: dict[str, Any]) -> int | None:
    """The chunk size ``_prefill`` should set for this call, or None to leave HF's setting alone.

    input_ids: [B, T] (the whole sequence, or only the new tokens when a filled cache is resumed). Not chunked:
    a caller's own ``prefill_chunk_size``, a cache that is not a MoENDCache (chunking would not bound its memory),
    and ``inputs_embeds`` prompts (HF's chunked prefill splits ``input_ids`` only)."""
    chunk, cache = state.get("prefill_chunk", 0), model_kwargs.get("cache")
    if (not chunk or generation_config.prefill_chunk_size is not None or not isinstance(cache, MoENDCache)
            or model_kwargs.get("inputs_embeds") is not None):
        return None
    total, past = input_ids.shape[-1], cache.get_seq_length()
    mask = model_kwargs.get("attention_mask")
    new = total - past if past and mask is not None and mask.shape[-1] == total else total
    return chunk if new > state.get("prefill_chunk_above", 0) else None


def _cache_options(model: Any, plan: RoutingPlan, table: Any, cache_kw: dict[str, Any]) -> dict[str, Any]:
    """The MoENDCache options ``prepare`` builds each cache with: ``cache_kw`` plus the model's RoPE and the
    table's query statistics unless given."""
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
        kw["query_stats"] = layer_query_stats(table)
    return kw


def _install(model: Any) -> dict[str, Any]:
    """Shadow ``model``'s generation methods (see the module docstring); returns the state they read."""
    original = model._prepare_cache_for_generation
    state = {"original": original, "attn": model.config._attn_implementation}

    def _prepare_cache(self: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any):
        st = getattr(self, _STATE)
        if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            model_kwargs["cache"] = MoENDCache(st["plan"], **st["cache_kw"])
            return None
        return st["original"](generation_config, model_kwargs, *args, **kwargs)

    def _prepare_inputs(self: Any, *args: Any, **kwargs: Any):
        cache = _find_cache(args, kwargs)
        if cache is not None:
            cache.before_step()
        return getattr(self, _STATE)["prepare_inputs"](*args, **kwargs)

    def _prefill(self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict, *args: Any,
                 **kwargs: Any):
        st = getattr(self, _STATE)
        chunk = _auto_chunk(st, input_ids, generation_config, model_kwargs)
        with contextlib.ExitStack() as stack:
            if not st["compile_prefill"]:
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            if chunk is None:
                return st["prefill"](input_ids, generation_config, model_kwargs, *args, **kwargs)
            generation_config.prefill_chunk_size = chunk  # this call's copy of the config
            try:
                return st["prefill"](input_ids, generation_config, model_kwargs, *args, **kwargs)
            finally:
                generation_config.prefill_chunk_size = None

    def _generate(self: Any, *args: Any, **kwargs: Any):
        with decode_compile_settings(), eager_if_assisted(self, kwargs):
            return getattr(self, _STATE)["generate"](*args, **kwargs)

    state["generate"] = model.generate
    state["prepare_inputs"] = model.prepare_inputs_for_generation
    state["prefill"] = model._prefill
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache, model)
    model.prepare_inputs_for_generation = types.MethodType(_prepare_inputs, model)
    model._prefill = types.MethodType(_prefill, model)
    model.generate = types.MethodType(_generate, model)
    install_handoff(model)  # GPT-NeoX: its attention does not pass the cache layer on (cache.layer_handoff)
    shadow_candidates(model)  # assisted decoding: the first forward is the prompt alone (see its docstring)
    setattr(model, _STATE, state)
    return state


def unprepare(model: Any) -> Any:
    """Undo :func:`prepare`: the original generate cache and attention implementation."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    for name in ("_prepare_cache_for_generation", "prepare_inputs_for_generation", "_prefill", "generate",
                 "_get_candidate_generator", "moend_plan"):
        model.__dict__.pop(name, None)  # the instance attributes; the class methods show again
    delattr(model, _STATE)
    remove_handoff(model)
    model.set_attn_implementation(state["attn"])
    return model
