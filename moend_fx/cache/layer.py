"""One compressed cache layer: a :class:`PackedKV`, its logical length, and the eviction policy.

The layer follows Hugging Face's ``CacheLayerMixin`` protocol (mirrors ``DynamicLayer``) with one twist:
attention is computed by the "moend" attention function (``moend_fx.cache.hf_attention``), which reaches this
object through the attention kwargs (``update`` puts itself under ``"moend_layer"`` in the kwargs dict the
attention module passes to ``cache.update(..., kwargs=kwargs)``). The order inside one attention module is:

1. ``update(k_new, v_new)``: a prefill on an empty layer is *staged* (held dense, returned as is so the attention
   function can run SDPA over it); otherwise the new tokens are appended to the packed storage. The residual
   window then holds 1..G tokens: a group filled by this step is quantized lazily (before the next append, or by
   ``settle`` / ``before_step``), so a compiled decode step never branches on whether it fills a group.
2. the attention function calls ``finish_prefill(q, mask)`` after SDPA on the staged K/V (evict + compress), or
   ``attend(q, mask)`` for a chunk / decode step over the packed storage (``attention_fn``, default
   :func:`moend_fx.attention.fused.fused_layer_attention`: the fused op eager, the pattern the ``moend`` backend
   fuses under compile), which then re-evicts when the policy (or the byte cap) says so.

Inside a ``torch.compile`` graph a decode step only appends and attends: the step count and the re-eviction are
deferred to :meth:`MoENDLayer.before_step`, run before the next step outside the graph. A prompt whose attention
ran elsewhere enters through :meth:`MoENDLayer.load_prefill` (``MoENDCache.from_prefill``). While recording its
past (``activate_past_recording``), what a forward adds stays open until ``crop``: ``moend_fx.cache.speculation``.

Lengths: ``get_seq_length`` / ``get_mask_sizes`` report the *logical* length (every token fed, padding included);
``held`` is what is stored. Stored positions are logical slot indices (column indices of HF's mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from moend_fx.attention.fused import fused_layer_attention
from moend_fx.cache import speculation
from moend_fx.cache.masks import held_attention, logical_mask
from moend_fx.cache.prefill_inputs import check_prefill_tensors
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.common.errors import MoendError
from moend_fx.eviction.capacity import LayerBudget
from moend_fx.eviction.evictor import Evictor
from moend_fx.eviction.held import DenseKV
from moend_fx.eviction.policy import EvictionPolicy
from moend_fx.eviction.scorers.base import Scorer
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV, slot_positions

__all__ = ["EvictionPolicy", "MoENDLayer", "PackedAttention"]

PackedAttention = Callable[..., torch.Tensor]


class MoENDLayer(CacheLayerMixin):
    """Compressed K/V of one transformer layer (see the module docstring for the protocol). What it keeps is
    its :class:`~moend_fx.eviction.evictor.Evictor`'s (``policy`` and ``scorer`` are the evictor's)."""

    is_compileable = False
    is_croppable = True  # while recording its past (activate_past_recording): moend_fx.cache.speculation
    is_sliding = False

    def __init__(
        self, config: LayerConfig, *, layer_idx: int, group_size: int = GROUP_SIZE, scorer: Scorer | None = None,
        policy: EvictionPolicy | None = None, attention_fn: PackedAttention | None = None,
        budget: LayerBudget | None = None, spare: Callable[[], Scorer] | None = None,
    ) -> None:
        super().__init__()
        self.config, self.layer_idx, self.group_size, self.budget = config, layer_idx, group_size, budget
        self.evictor = Evictor(config, group_size, policy or EvictionPolicy(), scorer, layer_idx=layer_idx,
                               budget=budget, spare=spare)
        self.attention_fn: PackedAttention = attention_fn or fused_layer_attention
        self.record_past = False  # HF's activate_past_recording: forwards stay open until crop
        self._clear()

    def _clear(self) -> None:
        self.packed: PackedKV | None = None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: str | None = None  # "prefill" | "packed" while an update awaits its attention
        self.logical = 0  # tokens fed so far (padding included): what HF sees as the sequence length
        self.open: list[speculation.OpenStep] = []  # forwards a crop may still take back (recording only)
        self.evictor.clear()

    policy: EvictionPolicy = property(lambda self: self.evictor.policy)  # type: ignore[assignment]
    scorer: Scorer | None = property(lambda self: self.evictor.scorer)  # type: ignore[assignment]
    evictions: int = property(lambda self: self.evictor.evictions)  # type: ignore[assignment]  # times evicted

    # ------------------------------------------------------------------ CacheLayerMixin protocol
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add key_states, value_states: [B, Hkv, L, D] (post-RoPE). Returns them unchanged (see module doc)."""
        if self._pending is not None:
            raise MoendError(
                f"layer {self.layer_idx}: the previous update was never attended by the 'moend' attention "
                "function (attn_implementation is not 'moend'); call moend_fx.prepare(model, plan) or "
                "model.set_attn_implementation('moend') before using MoENDCache"
            )
        if self.evictor.deferred:  # nobody called before_step: finish now (a graph break when compiled)
            self.packed = self.evictor.finish_deferred(self.packed, self.logical)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["moend_layer"] = self
        if self.record_past:  # what the step adds stays open until its crop (moend_fx.cache.speculation)
            speculation.open_step(self, key_states, value_states)
        start, n_new = self.logical, key_states.shape[2]
        self.logical += n_new
        if self.packed is None:
            self._staged = (key_states, value_states)
            self._pending = "prefill"
            return key_states, value_states
        pos = None if self.packed.positions is None else slot_positions(start, start + n_new, key_states)
        # keep_full: a group filled by this step is quantized before the next one (flush in before_step), so a
        # compiled decode step has one code path whatever the residual length.
        self.packed = self.packed.append(key_states, value_states, pos, keep_full=True)
        self._pending = "packed"
        return key_states, value_states

    def get_seq_length(self) -> int:  # the logical length (every token fed)
        return self.logical

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.logical + query_length, 0

    get_max_length = staticmethod(lambda: -1)  # no maximum: the cache evicts

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:  # drop the -tokens_to_remove newest (open) tokens
        speculation.crop(self, tokens_to_remove)

    def activate_past_recording(self) -> None:  # transformers' assisted decoding calls it before its first forward
        self.record_past = True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep batch rows ``beam_idx`` [B'] (beam search); every stored tensor is batch-first."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.as_tensor(indices, device=self.device).long()
        if self._pending is not None:
            raise MoendError("cannot reorder the cache between an update and its attention")
        speculation.crop(self, 0)
        self.settle()  # a deferred eviction uses the step's mask, whose rows are in the old order
        if self.packed is not None:
            self.packed = self.packed.index_batch(idx)
        self.evictor.index_batch(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.batch_size > 0:
            idx = torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats)
            self.batch_select_indices(idx)

    # ------------------------------------------------------------------ introspection
    @property
    def held(self) -> int:
        """Tokens stored per (batch row, KV head)."""
        if self._staged is not None:
            return self._staged[0].shape[2]
        return 0 if self.packed is None else self.packed.num_tokens

    @property
    def batch_size(self) -> int:
        if self._staged is not None:
            return self._staged[0].shape[0]
        return 0 if self.packed is None else self.packed.k_res.shape[0]

    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds: the packed storage (codes, scales, residual, positions; the
        staged dense K/V while mid-prefill) plus the eviction state (:meth:`state_nbytes`)."""
        self.settle()
        if self._staged is not None:
            stored = sum(t.numel() * t.element_size() for t in self._staged)
        else:
            stored = 0 if self.packed is None else self.packed.nbytes()
        return stored + self.state_nbytes()

    def model_nbytes(self) -> int:
        """What the memory model (:attr:`budget`, the count the cap and the solvers share) says the layer holds."""
        self.settle()
        if self.packed is None or self.budget is None:
            return 0
        return self.budget.held(self.held, self.logical, self.evictor.queries_seen, batch=self.batch_size,
                                dtype=self.packed.dtype, evicting=self.evictor.evicting)

    def state_nbytes(self) -> int:
        """Bytes of the eviction state: the scorer's query window (none for trig with calibrated stats, keynorm,
        streaming), the rows' RoPE offsets and the tensors the scorer holds (trig's calibrated statistics)."""
        return self.evictor.nbytes()

    pending_prefill: bool = property(lambda self: self._pending == "prefill")  # type: ignore[assignment]

    def stored_tensors(self, *, growing: bool = False) -> list[torch.Tensor]:
        """Every tensor with a token axis at dim 2 this layer holds: the PackedKV's and the scorer's query window
        (growing: leave out what never grows, ``PackedKV.tensors``)."""
        return ([] if self.packed is None else self.packed.tensors(growing=growing)) + self.evictor.tensors()

    # ------------------------------------------------------------------ called by the attention function
    def finish_prefill(
        self, query: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> None:
        """After SDPA over the staged prompt: evict to the policy's share, compress, drop the dense K/V.
        query: [B, H, T, D] post-RoPE; mask: HF's mask [B, 1, T, T] or None (no padding)."""
        if self._pending != "prefill" or self._staged is None:
            raise MoendError(f"layer {self.layer_idx}: finish_prefill without a staged prefill")
        k, v = self._staged
        self._pending = None
        lmask = logical_mask(mask, query.shape[2], self.logical, f"layer {self.layer_idx}")
        if self.open:  # recording: stays staged (dense) until its crop
            return self.open[-1].attended(query, lmask, position_ids)
        self._staged = None
        self.evictor.observe(query, self.logical, position_ids)
        self._compress_prompt(k, v, lmask)

    def load_prefill(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None) -> None:
        """Fill this empty layer with a prompt whose attention already ran elsewhere (e.g. a DynamicCache prefill):
        the layer is left exactly as a prefill of those tokens through the "moend" attention function leaves it
        (its own eviction with its scorer, sinks and recent window, then quantization), without attention.

        keys, values: [B, Hkv, T, D] post-RoPE, unpadded. queries: [B, H, W, D] post-RoPE queries of the prompt's
        last W tokens (1 <= W <= T; W >= min(T, window) gives the same window as a real prefill); None = no
        queries, which a scorer that needs them (trig without calibrated stats, snapkv, h2o) cannot do without.
        """
        where = f"layer {self.layer_idx}"
        if self.packed is not None or self._staged is not None or self.logical:
            raise MoendError(f"{where}: load_prefill needs an empty layer; it already holds {self.logical} tokens "
                             "(build a fresh cache, or reset() it)")
        needs = self.config.evicts and self.evictor.needs_queries
        shape = check_prefill_tensors(where, keys, values, queries, needs_queries=needs, config=self.config.name,
                                      scorer=None if self.scorer is None else str(self.scorer.name))
        self.lazy_initialization(keys, values)
        self.logical = shape.tokens
        if queries is None:
            self.evictor.unpadded(shape.batch, keys.device, shape.tokens)
        else:
            # the W queries are those of the prompt's last W slots, as observe sees them in a real prefill
            self.evictor.observe(queries, self.logical, None)
        self._compress_prompt(keys, values, None)

    def _compress_prompt(self, k: torch.Tensor, v: torch.Tensor, lmask: torch.Tensor | None) -> None:
        """Evict the prompt k, v: [B, Hkv, T, D] to the policy's share and quantize it into the PackedKV."""
        pos = slot_positions(0, k.shape[2], k) if self.config.evicts else None
        # Evict on the exact prompt K/V, then quantize once (not quantize, dequantize and re-quantize).
        self.packed = self.evictor.evict(DenseKV(k, v, pos), lmask, chunk=True, logical=self.logical)

    def attend(
        self, query: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of query: [B, H, L, D] (the newest L tokens, already appended) over the held tokens.

        mask: HF's logical mask [B, 1, L, S_logical] or None; its columns are gathered at the held positions.
        Returns [B, H, L, D]. Re-evicts afterwards when the policy says so.
        """
        if self._pending != "packed" or self.packed is None:
            raise MoendError(f"layer {self.layer_idx}: attend without a preceding update")
        self._pending = None
        n_q = query.shape[2]
        lmask = logical_mask(mask, n_q, self.logical, f"layer {self.layer_idx}")
        if self.open:  # recording: each row as one-by-one decoding computes it; observed and evicted at the crop
            return speculation.attend_open(self, query, lmask, scale, position_ids)
        out = held_attention(self.attention_fn, query, self.packed, lmask, scale)
        self.evictor.observe(query, self.logical, position_ids)
        if n_q > 1:
            self.packed = self.evictor.evict(self.packed, lmask, chunk=True, logical=self.logical)
        elif torch.compiler.is_compiling():
            self.evictor.defer(lmask)  # counted and evicted by before_step, outside the graph
        else:
            self.packed = self.evictor.decode_step(self.packed, lmask, self.logical)
        return out

    def start_evicting(self) -> None:
        """Capacity mode, between steps: a layer that keeps every token starts evicting (``MoENDCache.before_step``)."""
        if self.packed is not None and self.policy.capped and not self.evictor.evicting:
            self.packed = self.evictor.start(self.packed, self.logical)

    def before_step(self) -> None:
        """Run outside any compiled region before a forward: finish a deferred decode step (count it, evict
        when due), then mark the token axis (dim 2) of every stored tensor that grows dynamic so that a growing
        cache does not recompile the decode graph once per new size. An always-empty V residual stays static: one
        symbol fewer per layer (SmolLM2's cold compile at 2k 5-9% shorter in four alternating pairs of runs)."""
        self.settle()
        for t in self.stored_tensors(growing=True):
            torch._dynamo.maybe_mark_dynamic(t, 2)

    def settle(self) -> None:
        """Between steps (eager code, never traced): finish a decode step deferred by a compiled graph, then flush
        a full residual window, so the storage is what ``memory.layer_bytes`` counts for the held tokens."""
        if self.evictor.deferred:
            self.packed = self.evictor.finish_deferred(self.packed, self.logical)
        if self._pending is None and self.packed is not None:
            self.packed = self.packed.flush()
