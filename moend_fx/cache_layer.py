"""One compressed cache layer: a :class:`PackedKV`, its logical length, and the eviction policy.

The layer follows Hugging Face's ``CacheLayerMixin`` protocol (mirrors ``DynamicLayer``) with one
twist: attention is computed by the "moend" attention function (``moend_fx.hf_attention``), which
reaches this object through the attention kwargs (``update`` puts itself under ``"moend_layer"``
in the kwargs dict the attention module passes to ``cache.update(..., kwargs=kwargs)`` and then
to the attention function). The order inside one attention module is:

1. ``update(k_new, v_new)``: a prefill on an empty layer is *staged* (held dense, returned as is so
   the attention function can run SDPA over it); otherwise the new tokens are appended to the
   packed storage (residual window, full groups flushed) and returned unchanged.
2. the attention function calls ``finish_prefill(q, mask)`` after SDPA on the staged K/V (evict +
   compress; the dense K/V are dropped), or ``attend(q, mask)`` for a chunk / decode step over the
   packed storage (``attention_fn``, default :func:`moend_fx.attention.reference_attention`), which
   then re-evicts when the policy says so.

Lengths: ``get_seq_length`` / ``get_mask_sizes`` report the *logical* length (every token fed,
padding included) since they drive position ids and mask sizes; ``held`` is what is stored.
Positions stored with evicting layers are logical slot indices (column indices of HF's mask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from moend_fx.attention import reference_attention
from moend_fx.errors import MoendError
from moend_fx.memory import keep_count
from moend_fx.packed import PackedKV
from moend_fx.plan import LayerConfig
from moend_fx.quant import QuantizedTensor
from moend_fx.scoring import Scorer, TrigScorer, select_tokens

BUDGET_MODES = ("ratio", "capacity")
PackedAttention = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class EvictionPolicy:
    """When and how far a layer evicts.

    ratio: after the prompt (and after each prefill chunk) keep ``keep_count(seen, keep_ratio)``; during
    decode re-evict to that every ``evict_every`` steps (in between the held count grows by < evict_every).
    capacity: never hold more than ``cap`` tokens; when a new token would exceed it, evict down to
    ``cap - slack`` (slack = min(evict_every - 1, cap // 2)) so eviction re-runs about every evict_every steps.
    ``seen`` counts a row's real (unmasked) tokens, so padding never earns a row extra tokens.
    """

    budget_mode: str = "ratio"
    evict_every: int = 128
    window: int = 32
    sink_tokens: int = 4
    recent_tokens: int = 32
    cap: int | None = None  # capacity mode: keep_count(plan.context_length, keep_ratio)

    def __post_init__(self) -> None:
        if self.budget_mode not in BUDGET_MODES:
            raise MoendError(f"budget_mode={self.budget_mode!r} is unknown; allowed: {list(BUDGET_MODES)}")
        for name in ("evict_every", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoendError(f"{name}={v!r} is invalid; allowed: an integer >= 1")
        if self.budget_mode == "capacity" and (self.cap is None or self.cap < 1):
            raise MoendError(f"capacity mode needs cap >= 1; got cap={self.cap!r}")

    @property
    def low_water(self) -> int:
        assert self.cap is not None
        return max(1, self.cap - min(self.evict_every - 1, self.cap // 2))


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


class MoENDLayer(CacheLayerMixin):
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
        self.attention_fn: PackedAttention = attention_fn or reference_attention
        self._clear()

    def _clear(self) -> None:
        self.packed: PackedKV | None = None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: str | None = None  # "prefill" | "packed" while an update awaits its attention
        self.logical = 0  # tokens fed so far (padding included): what HF sees as the sequence length
        self.decode_steps = 0
        self.evictions = 0
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
        self.packed = self.packed.append(key_states, value_states, pos)
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
        if n_q == 1:
            self.decode_steps += 1
        self._maybe_evict(lmask, chunk=n_q > 1)
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

    # ------------------------------------------------------------------ eviction
    def _targets(
        self, n: int, real_seen: torch.Tensor, real_held: torch.Tensor, chunk: bool
    ) -> torch.Tensor | None:
        """Per-row tokens to keep [B] out of the ``n`` held, or None when no eviction is due."""
        pol = self.policy
        if pol.budget_mode == "ratio":
            if not chunk and self.decode_steps % pol.evict_every:
                return None
            t = torch.tensor([keep_count(int(s), self.config.keep_ratio) for s in real_seen.tolist()])
        else:
            if n <= pol.cap:
                return None
            t = torch.full_like(real_seen.cpu(), pol.low_water)
        t = torch.minimum(t, real_held.cpu())
        if int(t.max()) >= n:
            return None
        return t

    def _maybe_evict(
        self, lmask: torch.Tensor | None, chunk: bool,
        dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ) -> None:
        """Evict when the policy says so. ``dense``: (k, v, positions) of a prompt not yet compressed; the
        layer's PackedKV is then built from it (evicted or not)."""
        if dense is not None:
            k, v, pos32 = dense
            n = k.shape[2]
        elif self.packed is None:
            return
        else:
            k = v = None
            pos32, n = self.packed.positions, self.packed.num_tokens
        if not self.config.evicts:
            cap = self.policy.cap
            if self.policy.budget_mode == "capacity" and cap is not None and n > cap:
                raise MoendError(
                    f"layer {self.layer_idx} ({self.config.name}) keeps every token and now holds {n} > "
                    f"its capacity {cap} (the plan's context_length): it cannot evict without positions, which "
                    "the plan did not budget. Use budget_mode='ratio', or a plan with a larger context_length"
                )
            if dense is not None:
                self.packed = PackedKV.from_dense(k, v, self.config, self.group_size, pos32)
            return
        b, hkv, _ = pos32.shape
        pos = pos32.long()
        valid = last = None
        if lmask is not None:
            last = lmask[:, 0, -1, :]  # [B, S]: the newest query (always real) sees every real token
            real_seen = last.sum(-1)
            valid = last.gather(1, pos.reshape(b, -1)).reshape(b, hkv, n)
            if bool(valid.all()):
                valid = None
        else:
            real_seen = torch.full((b,), self.logical, dtype=torch.long)
        real_held = torch.full((b,), n, dtype=torch.long) if valid is None else valid[:, 0].sum(-1)
        targets = self._targets(n, real_seen, real_held, chunk)
        if targets is None:
            if dense is not None:
                self.packed = PackedKV.from_dense(k, v, self.config, self.group_size, pos32)
            return
        if dense is None:
            k, v = self.packed.dequantize()
        rope_pos = (pos - self._rope_offset.to(pos.device)[:, None, None]).clamp_min(0)
        if valid is None and bool((targets == targets[0]).all()):
            idx = self._select(k, v, pos, rope_pos, int(targets[0]))
            new_pos = pos.gather(2, idx)
            gidx = idx[..., None].expand(-1, -1, -1, k.shape[-1])
            k_sel, v_sel = k.gather(2, gidx), v.gather(2, gidx)
        else:
            k_sel, v_sel, new_pos = self._evict_rows(k, v, pos, rope_pos, valid, last, targets)
        self.packed = PackedKV.from_dense(k_sel, v_sel, self.config, self.group_size, new_pos)
        self.evictions += 1

    def _select(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, rope_pos: torch.Tensor, n_keep: int,
        row: int | None = None, q_keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Indices [b, Hkv, n_keep] of the tokens to keep among k, v: [b, Hkv, n, D] (b = 1 when ``row``).

        q_keep: [W] bool, which window queries of ``row`` are real tokens (None = all)."""
        q = qpos = None
        if self._q_win is not None:
            q, qpos = self._q_win, self._q_pos
            if row is not None:
                q, qpos = q[row : row + 1], qpos[row : row + 1]
            if q_keep is not None:
                q, qpos = q[:, :, q_keep], qpos[:, q_keep]
        scores = self.scorer.score(k, v, queries=q, key_positions=rope_pos, query_positions=qpos)
        idx, _ = select_tokens(scores, n_keep, sink_tokens=self.policy.sink_tokens,
                               recent_tokens=self.policy.recent_tokens, key_positions=pos)
        return idx

    def _evict_rows(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, rope_pos: torch.Tensor,
        valid: torch.Tensor | None, last: torch.Tensor | None, targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Evict row by row over each row's real tokens only, so a padded row keeps exactly what it would keep
        alone; rows short of the common length are topped up with masked filler tokens (zeros placed at a
        padding slot of that row, so the gathered mask hides them)."""
        b, hkv, n_held, d = k.shape
        n = int(targets.max())
        ks, vs, ps = [], [], []
        for r in range(b):
            if valid is None:
                real = torch.arange(n_held, device=k.device)
            else:
                real = valid[r, 0].nonzero().squeeze(-1)  # pads sit at the same slots in every KV head
            q_keep = None
            if self._q_slots is not None and last is not None:
                q_keep = last[r].gather(0, self._q_slots.to(last.device))
            pads = (~last[r]).nonzero() if last is not None else last
            n_r = int(targets[r]) if pads is not None and len(pads) else n
            idx = self._select(k[r : r + 1, :, real], v[r : r + 1, :, real], pos[r : r + 1, :, real],
                               rope_pos[r : r + 1, :, real], n_r, r, q_keep)
            idx = real[idx]  # [1, Hkv, n_r] into the held tokens
            kr = k[r : r + 1].gather(2, idx[..., None].expand(-1, -1, -1, d))
            vr = v[r : r + 1].gather(2, idx[..., None].expand(-1, -1, -1, d))
            pr = pos[r : r + 1].gather(2, idx)
            if n_r < n:
                pad_slot = int(pads[0])
                fill = n - n_r
                kr = torch.cat([k.new_zeros(1, hkv, fill, d), kr], dim=2)
                vr = torch.cat([v.new_zeros(1, hkv, fill, d), vr], dim=2)
                pr = torch.cat([pr.new_full((1, hkv, fill), pad_slot), pr], dim=2)
                order = pr.argsort(dim=2, stable=True)
                kr = kr.gather(2, order[..., None].expand(-1, -1, -1, d))
                vr = vr.gather(2, order[..., None].expand(-1, -1, -1, d))
                pr = pr.gather(2, order)
            ks.append(kr)
            vs.append(vr)
            ps.append(pr)
        return torch.cat(ks), torch.cat(vs), torch.cat(ps)
