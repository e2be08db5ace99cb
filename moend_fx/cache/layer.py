"""One compressed cache layer: a :class:`PackedKV`, its logical length, and the eviction policy.

The layer follows Hugging Face's ``CacheLayerMixin`` protocol (mirrors ``DynamicLayer``) with one
twist: attention is computed by the "moend" attention function (``moend_fx.cache.hf_attention``), which
reaches this object through the attention kwargs (``update`` puts itself under ``"moend_layer"``
in the kwargs dict the attention module passes to ``cache.update(..., kwargs=kwargs)`` and then
to the attention function). The order inside one attention module is:

1. ``update(k_new, v_new)``: a prefill on an empty layer is *staged* (held dense, returned as is so
   the attention function can run SDPA over it); otherwise the new tokens are appended to the
   packed storage and returned unchanged. The residual window then holds 1..G tokens: a group filled by
   this step is quantized lazily (before the next append, or by ``settle`` / ``before_step``), so a
   compiled decode step never branches on whether it fills a group.
2. the attention function calls ``finish_prefill(q, mask)`` after SDPA on the staged K/V (evict +
   compress; the dense K/V are dropped), or ``attend(q, mask)`` for a chunk / decode step over the
   packed storage (``attention_fn``, default :func:`moend_fx.attention.packed.packed_layer_attention`, the
   form the ``moend`` compile backend fuses), which then re-evicts when the policy says so.

Inside a ``torch.compile`` graph a decode step only appends and attends: the step count and the re-eviction
(plain eager code, ``moend_fx.eviction.policy``) are deferred to :meth:`MoENDLayer.before_step`, which the cache runs
before the next step, outside the graph (``moend_fx.prepare`` installs that hook on ``generate``).

A prompt whose attention already ran elsewhere (a full-precision DynamicCache prefill) enters an empty layer
through :meth:`MoENDLayer.load_prefill` (the same eviction and quantization as ``finish_prefill``, no attention);
``MoENDCache.from_prefill`` calls it per layer.

Lengths: ``get_seq_length`` / ``get_mask_sizes`` report the *logical* length (every token fed,
padding included) since they drive position ids and mask sizes; ``held`` is what is stored.
Positions stored with evicting layers are logical slot indices (column indices of HF's mask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from moend_fx.attention.packed import packed_layer_attention
from moend_fx.cache.prefill_inputs import check_prefill_tensors
from moend_fx.common.errors import MoendError
from moend_fx.eviction.policy import BUDGET_MODES, Evicting, EvictionPolicy
from moend_fx.eviction.scoring import Scorer, TrigScorer
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV
from moend_fx.storage.quant import QuantizedTensor

__all__ = ["BUDGET_MODES", "EvictionPolicy", "MoENDLayer", "PackedAttention"]

PackedAttention = Callable[..., torch.Tensor]


def _index_batch(x: Any, index: torch.Tensor) -> Any:
    """Select batch rows ``index`` of a raw tensor or a QuantizedTensor (all fields are batch-first)."""
    if x is None:
        return None
    if isinstance(x, QuantizedTensor):
        return replace(x, codes=x.codes.index_select(0, index), scale=x.scale.index_select(0, index),
                       zero=x.zero.index_select(0, index))
    return x.index_select(0, index.to(x.device))


def _needs_queries(scorer: Scorer | None) -> bool:
    if scorer is None or scorer.name in ("keynorm", "streaming"):
        return False
    return not (isinstance(scorer, TrigScorer) and scorer.stats is not None)


class MoENDLayer(Evicting, CacheLayerMixin):
    """Compressed K/V of one transformer layer (see the module docstring for the protocol)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self, config: LayerConfig, *, layer_idx: int, group_size: int = 32, scorer: Scorer | None = None,
        policy: EvictionPolicy | None = None, attention_fn: PackedAttention | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.group_size = group_size
        self.policy = policy or EvictionPolicy()
        if config.evicts and scorer is None:
            raise MoendError(f"layer {layer_idx} ({config.name}) evicts tokens, so it needs a scorer")
        self.scorer = scorer
        self.attention_fn: PackedAttention = attention_fn or packed_layer_attention
        self._clear()

    def _clear(self) -> None:
        self.packed: PackedKV | None = None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: str | None = None  # "prefill" | "packed" while an update awaits its attention
        self.logical = 0  # tokens fed so far (padding included): what HF sees as the sequence length
        self.decode_steps = 0
        self.evictions = 0
        # A decode step that ran inside a compiled graph left its step count and eviction to before_step:
        # (True, the step's bool mask [B, 1, 1, S] or None), else (False, None).
        self._deferred: tuple[bool, torch.Tensor | None] = (False, None)
        self._rope_offset: torch.Tensor | None = None  # [B] slot - RoPE position (left padding)
        # Scorer scratch (not part of the cache's bytes): last W post-RoPE queries, their slots and RoPE positions.
        self._q_win: torch.Tensor | None = None  # [B, H, W, D]
        self._q_slots: torch.Tensor | None = None  # [W] int64
        self._q_pos: torch.Tensor | None = None  # [B, W] int64

    # ------------------------------------------------------------------ CacheLayerMixin protocol
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add key_states, value_states: [B, Hkv, L, D] (post-RoPE). Returns them unchanged (see module doc)."""
        if self._pending is not None:
            raise MoendError(
                f"layer {self.layer_idx}: the previous update was never attended by the 'moend' attention "
                f"function (attn_implementation is {self._attn_hint()}); call moend_fx.prepare(model, plan) or "
                "model.set_attn_implementation('moend') before using MoENDCache"
            )
        if self._deferred[0]:
            self._finish_deferred()  # nobody called before_step: do it now (a graph break when compiled)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["moend_layer"] = self
        start, n_new = self.logical, key_states.shape[2]
        self.logical += n_new
        if self.packed is None:
            self._staged = (key_states, value_states)
            self._pending = "prefill"
            return key_states, value_states
        pos = None
        if self.packed.positions is not None:
            b, h = key_states.shape[:2]
            pos = torch.arange(start, start + n_new, device=key_states.device, dtype=torch.int32)
            pos = pos.expand(b, h, n_new)
        # keep_full: a group filled by this step is quantized before the next one (flush in before_step), so a
        # compiled decode step has one code path whatever the residual length.
        self.packed = self.packed.append(key_states, value_states, pos, keep_full=True)
        self._pending = "packed"
        return key_states, value_states

    def _attn_hint(self) -> str:
        return "not 'moend'"

    def get_seq_length(self) -> int:
        return self.logical

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.logical + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise MoendError("MoENDCache cannot crop (tokens are evicted and packed); assisted/speculative "
                         "decoding that rolls the cache back is not supported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep batch rows ``beam_idx`` [B'] (beam search); every stored tensor is batch-first."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.as_tensor(indices, device=self.device).long()
        if self._pending is not None:
            raise MoendError("cannot reorder the cache between an update and its attention")
        self.settle()  # a deferred eviction uses the step's mask, whose rows are in the old order
        if self.packed is not None:
            p = self.packed
            self.packed = replace(
                p, k_packed=_index_batch(p.k_packed, idx), v_packed=_index_batch(p.v_packed, idx),
                k_res=_index_batch(p.k_res, idx), v_res=_index_batch(p.v_res, idx),
                positions=_index_batch(p.positions, idx),
            )
        self._q_win = _index_batch(self._q_win, idx)
        self._q_pos = _index_batch(self._q_pos, idx)
        self._rope_offset = _index_batch(self._rope_offset, idx)

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
        """Bytes stored (packed codes, scales, residual, positions); staged dense K/V while mid-prefill."""
        self.settle()
        if self._staged is not None:
            return sum(t.numel() * t.element_size() for t in self._staged)
        return 0 if self.packed is None else self.packed.nbytes()

    def scratch_nbytes(self) -> int:
        """Bytes of the scorer's query window (not K/V storage; absent for trig with calibrated stats)."""
        return sum(t.numel() * t.element_size() for t in (self._q_win, self._q_pos) if t is not None)

    @property
    def pending_prefill(self) -> bool:
        return self._pending == "prefill"

    # ------------------------------------------------------------------ called by the attention function
    def _mask_bool(self, mask: torch.Tensor | None, n_queries: int) -> torch.Tensor | None:
        """The logical mask as bool [B, 1, L, S_logical] (True = may attend), or None."""
        if mask is None:
            return None
        if mask.dim() != 4 or mask.shape[-1] != self.logical or mask.shape[-2] != n_queries:
            raise MoendError(
                f"layer {self.layer_idx}: attention mask {tuple(mask.shape)} must be [B, 1, L={n_queries}, "
                f"S={self.logical}] (the logical length); a custom 4D mask must cover every token fed"
            )
        if mask.dtype != torch.bool:
            mask = mask == 0  # additive float mask: 0 = attend, -inf (or min) = masked
        return mask[:, :1]

    def _track(self, q: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Record the RoPE offset per row and the scorer's window of the last W queries q: [B, H, L, D]."""
        b, _, n_q, _ = q.shape
        slots = torch.arange(self.logical - n_q, self.logical, device=q.device)
        if position_ids is not None:
            pid = position_ids.to(q.device).long().expand(b, -1)[:, -n_q:]
            self._rope_offset = slots[-1] - pid[:, -1]
        elif self._rope_offset is None:
            self._rope_offset = torch.zeros(b, dtype=torch.long, device=q.device)
        if not _needs_queries(self.scorer):
            return
        w = self.policy.window
        qpos = slots[None, :] - self._rope_offset[:, None]
        q = q[:, :, -w:]
        slots, qpos = slots[-w:], qpos[:, -w:]
        if self._q_win is not None and q.shape[2] < w:
            q = torch.cat([self._q_win, q], dim=2)[:, :, -w:]
            slots = torch.cat([self._q_slots, slots])[-w:]
            qpos = torch.cat([self._q_pos, qpos], dim=1)[:, -w:]
        self._q_win, self._q_slots, self._q_pos = q.detach(), slots, qpos

    def finish_prefill(
        self, query: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> None:
        """After SDPA over the staged prompt: evict to the policy's share, compress, drop the dense K/V.

        query: [B, H, T, D] post-RoPE; mask: HF's mask [B, 1, T, T] or None (no padding).
        """
        if self._pending != "prefill" or self._staged is None:
            raise MoendError(f"layer {self.layer_idx}: finish_prefill without a staged prefill")
        k, v = self._staged
        self._staged, self._pending = None, None
        lmask = self._mask_bool(mask, query.shape[2])
        self._track(query, position_ids)
        self._compress_prompt(k, v, lmask)

    def load_prefill(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None) -> None:
        """Fill this empty layer with a prompt whose attention already ran elsewhere (e.g. a DynamicCache prefill):
        the layer is left exactly as a prefill of those tokens through the "moend" attention function leaves it
        (its own eviction with its scorer, sinks and recent window, then quantization), without attention.

        keys, values: [B, Hkv, T, D] post-RoPE, unpadded (every row's T tokens are real).
        queries: [B, H, W, D] post-RoPE queries of the prompt's last W tokens (1 <= W <= T; the scorer's window
        keeps the last ``policy.window`` of them, so W >= min(T, window) gives the same window as a real
        prefill); None = no queries, which a scorer that needs them (trig without calibrated stats, snapkv,
        h2o) cannot do without: a MoendError.
        """
        where = f"layer {self.layer_idx}"
        if self.packed is not None or self._staged is not None or self.logical:
            raise MoendError(f"{where}: load_prefill needs an empty layer; it already holds {self.logical} tokens "
                             "(build a fresh cache, or reset() it)")
        needs = self.config.evicts and _needs_queries(self.scorer)
        check_prefill_tensors(where, keys, values, queries, needs_queries=needs,
                              scorer=getattr(self.scorer, "name", None), config=self.config.name)
        b, t = keys.shape[0], keys.shape[2]
        self.lazy_initialization(keys, values)
        self.logical = t
        if queries is None:
            self._rope_offset = torch.zeros(b, dtype=torch.long, device=keys.device)
        else:
            # the W queries are those of the prompt's last W slots, as _track sees them in a real prefill
            self._track(queries, None)
        self._compress_prompt(keys, values, None)

    def _compress_prompt(self, k: torch.Tensor, v: torch.Tensor, lmask: torch.Tensor | None) -> None:
        """Evict the prompt k, v: [B, Hkv, T, D] to the policy's share and quantize it into the PackedKV."""
        pos = None
        if self.config.evicts:
            b, h, n = k.shape[:3]
            pos = torch.arange(n, device=k.device, dtype=torch.int32).expand(b, h, n)
        # Evict on the exact prompt K/V, then quantize once (not quantize, dequantize and re-quantize).
        self._maybe_evict(lmask, chunk=True, dense=(k, v, pos))

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
        lmask = self._mask_bool(mask, n_q)
        held_mask = None
        if lmask is not None:
            held_mask = self._gather_mask(lmask, query.shape[1])
        out = self.attention_fn(query, self.packed, scale=scale, causal_chunk=True, mask=held_mask)
        self._track(query, position_ids)
        if n_q == 1 and torch.compiler.is_compiling():
            # Counting and evicting read Python ints and data-dependent sizes: left to before_step, outside
            # the graph, so the compiled decode step stays one graph with no guard on the step count.
            self._deferred = (True, lmask)
            return out
        if n_q == 1:
            self.decode_steps += 1
        self._maybe_evict(lmask, chunk=n_q > 1)
        return out

    def before_step(self) -> None:
        """Run outside any compiled region before a forward: finish a deferred decode step (count it, evict
        when due), then mark the token axis (dim 2) of every stored tensor dynamic so that a growing cache does
        not recompile the decode graph once per new size."""
        self.settle()
        for t in self.stored_tensors():
            torch._dynamo.maybe_mark_dynamic(t, 2)

    def settle(self) -> None:
        """Between steps (eager code, never traced): finish a decode step deferred by a compiled graph, then flush
        a full residual window, so the storage is what ``memory.layer_bytes`` counts for the held tokens."""
        if self._deferred[0]:
            self._finish_deferred()
        if self._pending is None and self.packed is not None:
            self.packed = self.packed.flush()

    @torch.compiler.disable
    def _finish_deferred(self) -> None:
        _, lmask = self._deferred
        self._deferred = (False, None)
        self.decode_steps += 1
        self._maybe_evict(lmask, chunk=False)

    def stored_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a token axis at dim 2 this layer holds: the PackedKV's fields and the scorer's
        query window."""
        out: list[torch.Tensor] = []
        p = self.packed
        if p is not None:
            for block in (p.k_packed, p.v_packed):
                out += [block] if isinstance(block, torch.Tensor) else [block.codes, block.scale, block.zero]
            out += [p.k_res, p.v_res] + ([p.positions] if p.positions is not None else [])
        if self._q_win is not None:
            out.append(self._q_win)
        return out

    def _gather_mask(self, lmask: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Logical mask [B, 1, L, S] -> [B, 1 or H, L, n] at the held tokens' positions."""
        p = self.packed
        if p.positions is None:
            return lmask[..., : p.num_tokens]
        b, hkv, n = p.positions.shape
        l_q = lmask.shape[2]
        cols = p.positions.long()[:, :, None, :].expand(b, hkv, l_q, n)
        m = lmask.expand(b, hkv, l_q, lmask.shape[-1]).gather(3, cols)  # [B, Hkv, L, n]
        return m.repeat_interleave(num_heads // hkv, dim=1)
