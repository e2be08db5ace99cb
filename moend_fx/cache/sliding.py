"""A sliding-window cache layer (Gemma 2 / 3's local layers, Mistral with ``sliding_window``, Qwen2 with
``use_sliding_window``): a :class:`MoENDLayer` whose oldest tokens leave as new ones arrive.

A query at slot ``i`` of a sliding layer sees the keys at slots ``i - window + 1 .. i`` (transformers'
``sliding_window_overlay``), so between steps the layer needs only the last ``window - 1`` tokens, which is what
transformers' own ``DynamicSlidingWindowLayer`` keeps. :class:`SlidingLayer` keeps at most ``limit`` tokens between
steps: ``window - 1`` (or, in ``budget_mode="capacity"``, fewer when the plan was priced for a shorter context:
``ModelFingerprint.layer_tokens``), and of those the plan's keep ratio (``memory.sliding_kept``): a keep ratio below
1 narrows the window to its most recent tokens. It never evicts by score (a query-free scorer inside a ring of recent
tokens was not measured to help; the tokens a sliding layer drops are its oldest, which its next queries would lose
first anyway), and its K / V bits are the plan's.

How the oldest tokens leave: right after the step's attention (for a compiled step, in :meth:`settle`, outside the
graph, before the flush of a full residual group, so both orders leave the same cache),
* a layer with packed 4- or 8-bit K groups (quantized per channel along tokens) drops its oldest whole groups (kept
  codes stay bit for bit, nothing is re-quantized) until it holds ``limit`` tokens or fewer: it then attends to
  between ``limit - G + 1`` and ``limit`` past tokens (at most G - 1 of its oldest left with their group), never to
  more than it is priced for;
* everything else is one entry per token (16-bit K, K's residual window, V's per-token groups, positions) and is
  sliced exactly;
* and by bytes: a layer also drops its oldest tokens while it would take more than its cap (the memory model's bytes
  at ``limit`` tokens) once packed, since a count below ``limit`` can take more (its last tokens wait at 16 bits
  for their K group): so the cap holds at every step, at the cost of a shorter window where the cap is small.

The layer stores every held token's slot (``positions``), so HF's logical sliding mask is read at the held slots as
for any evicting layer (``moend_fx.cache.masks``), and the memory model counts them (``plan.memory``). It reports
``is_sliding = True`` as transformers expects (HF builds the sliding mask from the first such layer's sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from moend_fx.cache.layer import MoENDLayer, PackedAttention
from moend_fx.cache.masks import logical_mask
from moend_fx.common.errors import MoendError
from moend_fx.common.options import BudgetMode
from moend_fx.eviction.held import DenseKV
from moend_fx.eviction.policy import EvictionPolicy
from moend_fx.plan.memory import layer_bytes, sliding_kept
from moend_fx.plan.routing import LayerConfig, RoutingPlan
from moend_fx.storage.packed import PackedKV, slot_positions


@dataclass(frozen=True)
class SlidingBudget:
    """The memory model of a sliding layer: ``limit`` tokens at most, with positions, no eviction state."""

    config: LayerConfig
    limit: int
    context_length: int
    kv_heads: int
    head_dim: int
    group_size: int

    def held(self, kept: int, slots: int, queries: int = 0, *, batch: int, dtype: Any, evicting: bool = True) -> int:
        """Bytes of the layer holding ``kept`` tokens out of ``slots`` (``queries``, ``evicting``: unused, as
        :class:`~moend_fx.eviction.capacity.LayerBudget.held` takes them)."""
        return layer_bytes(self.config, 0, kv_heads=self.kv_heads, head_dim=self.head_dim, batch=batch,
                           group_size=self.group_size, dtype=dtype, kept=kept, slots=max(slots, 1), positions=True)

    def cap(self, *, batch: int, dtype: Any) -> int:
        """The bytes the plan gives this layer: ``limit`` tokens (or the plan's context, if shorter) of its slots."""
        return self.held(min(self.limit, self.context_length), self.context_length, batch=batch, dtype=dtype)


class SlidingLayer(MoENDLayer):
    """A :class:`MoENDLayer` over a sliding window: holds at most ``limit`` tokens between steps (module doc)."""

    is_sliding = True
    # croppable while recording (moend_fx.cache.speculation): the oldest tokens stay while a step is open and leave
    # as each kept token is replayed at the crop, so nothing a crop must restore is gone

    def __init__(self, config: LayerConfig, *, layer_idx: int, window: int, limit: int, budget: SlidingBudget,
                 group_size: int, attention_fn: PackedAttention | None = None) -> None:
        if not 1 <= limit <= max(window - 1, 1):
            raise MoendError(f"layer {layer_idx}: limit={limit} is invalid; allowed: 1 .. window - 1 = {window - 1}")
        self.window, self.limit, self.plan_config = window, limit, config
        # its storage and evictor see a config that keeps every token: a keep ratio < 1 narrows the window (limit)
        ring = LayerConfig(1.0, config.k_bits, config.v_bits)
        super().__init__(ring, layer_idx=layer_idx, group_size=group_size, scorer=None,
                         policy=EvictionPolicy(BudgetMode.RATIO), attention_fn=attention_fn)
        self.budget = budget  # the Evictor never caps a sliding layer: trimming bounds it

    def _compress_prompt(self, k: torch.Tensor, v: torch.Tensor, lmask: torch.Tensor | None) -> None:
        """Keep the prompt's last ``limit`` tokens of k, v: [B, Hkv, T, D], with their slots, and pack them."""
        t = k.shape[2]
        pos = slot_positions(0, t, k)
        keep = slice(max(t - self.limit, 0), t)
        kv = DenseKV(k[:, :, keep], v[:, :, keep], pos[:, :, keep])
        self.packed = self.evictor.evict(kv, lmask, chunk=True, logical=self.logical)

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.open:  # a recorded (verify / draft) step holds its older tokens: each query sees what decoding has
            n = query.shape[2]
            mask = _recent(logical_mask(mask, n, self.logical, f"layer {self.layer_idx}"), self._views()[-n:],
                           self.logical, query.device)
        out = super().attend(query, mask, scale, position_ids)
        if not torch.compiler.is_compiling():  # a compiled step's tokens leave in settle, outside the graph
            self._trim()
        return out

    def settle(self) -> None:
        """Finish a deferred decode step, let the oldest tokens leave, then flush (in that order, as an eager step
        does: a flush before the trim would pack a group the trim then has to drop whole)."""
        if self.evictor.deferred:
            self.packed = self.evictor.finish_deferred(self.packed, self.logical)
        if self._pending is None:
            self._trim()
        super().settle()

    def _trim(self) -> None:
        """Drop the oldest tokens until the layer holds at most ``limit`` and, as ``settle`` will pack it, at most
        its cap's bytes (a count below ``limit`` can take more: its last tokens wait at 16 bits for their K group).
        Whole packed K groups first (see the module docstring), then single tokens where every tensor is per token."""
        p = self.packed
        if p is None or self.open:  # recording: trimmed token by token as the crop replays the kept ones
            return
        batch, dtype = p.k_res.shape[0], p.dtype
        cap = self.budget.cap(batch=batch, dtype=dtype)

        def fits(n: int) -> bool:
            return n <= self.limit and self.budget.held(n, self.logical, batch=batch, dtype=dtype) <= cap

        while not fits(p.num_tokens) and p.num_packed and p.config.k_bits < 16:
            b, h = p.k_res.shape[:2]  # drop the oldest packed K group, kept codes bit for bit
            p = p.keep_groups(torch.arange(1, p.num_groups, device=p.k_res.device).expand(b, h, -1))
        if not fits(p.num_tokens):  # what is left is per token (raw K, per-token V groups): an exact slice
            keep = next((m for m in range(min(p.num_tokens, self.limit), 0, -1) if fits(m)), 0)
            p = _drop_oldest(p, p.num_tokens - keep)
        self.packed = p

    def _views(self) -> list[int]:
        """For each open token, oldest first, how many tokens (itself included) its query sees in one-by-one
        decoding: the count :meth:`_trim` leaves after each step before, counted from the state before the first
        open step (a full residual group is packed before the next append; whole packed K groups leave first)."""
        p, before, g = self.packed, self.open[0].before, self.group_size
        batch, dtype, quantized = p.k_res.shape[0], p.dtype, p.config.quantized
        cap = self.budget.cap(batch=batch, dtype=dtype)
        count, packed, views = before.tokens, before.k_packed, []
        for slots in range(self.open[0].start + 1, self.logical + 1):
            if quantized and count - packed == g:
                packed += g
            count += 1
            views.append(count)

            def fits(n: int, slots: int = slots) -> bool:
                return n <= self.limit and self.budget.held(n, slots, batch=batch, dtype=dtype) <= cap

            while not fits(count) and packed and p.config.k_bits < 16:
                packed, count = packed - g, count - g
            if not fits(count):
                count = next((m for m in range(min(count, self.limit), 0, -1) if fits(m)), 0)
                packed = count // g * g if quantized and packed else 0
        return views

    def replayed(self) -> None:
        """A token replayed at a crop (``speculation.replay_token``) leaves what a decode step's attention does."""
        self._trim()

    def model_nbytes(self) -> int:
        self.settle()
        if self.packed is None:
            return 0
        return self.budget.held(self.held, self.logical, batch=self.batch_size, dtype=self.packed.dtype)


def _recent(lmask: torch.Tensor | None, views: list[int], logical: int, device: torch.device) -> torch.Tensor:
    """The logical mask lmask [B, 1, L, S] (None: causal) of the newest L = len(views) slots narrowed so that the
    query at slot p sees only the ``views[i]`` slots up to p that one-by-one decoding holds there."""
    q = torch.arange(logical - len(views), logical, device=device)[:, None]
    lo = q - torch.tensor(views, device=device)[:, None]
    s = torch.arange(logical, device=device)[None, :]
    band = ((s <= q) & (s > lo))[None, None]  # [1, 1, L, S]
    return band if lmask is None else lmask & band


def _drop_oldest(p: PackedKV, n: int) -> PackedKV:
    """``p`` without its oldest ``n`` tokens. Every tensor left to cut has the token axis at dim 2 with one entry
    per token (raw K, packed or residual; per-token V codes, scales and zeros; positions), so a cut is exact.

    With nothing packed every tensor holds the same tokens and loses its first ``n``. A raw (16-bit) K with packed
    tokens is split in two (the packed part, whole groups, and the residual window, oldest first) beside a V packed
    on arrival (every token in its packed block): K's raw tokens lose their first ``n`` and are split again into
    whole groups and a residual window (the kernels read a packed part of whole groups), V and the positions lose
    their first ``n``."""
    cut = lambda t: t[:, :, n:]  # noqa: E731
    if not p.num_packed:
        return p.map(cut)
    if p.config.k_bits < 16 or not p.v_on_arrival:
        raise MoendError(f"cannot cut {n} tokens out of a layer's {p.num_groups} packed K groups")
    k = torch.cat([p.k_packed, p.k_res], dim=2)[:, :, n:]
    v_packed = cut(p.v_packed) if isinstance(p.v_packed, torch.Tensor) else p.v_packed.map(cut)
    left = replace(p, k_packed=k[:, :, :0], v_packed=v_packed)
    return left._flushed(k, p.v_res, None if p.positions is None else cut(p.positions),
                         k.shape[2] // p.group_size * p.group_size)


def sliding_layer(plan: RoutingPlan, layer: int, *, budget_mode: str, attention_fn: PackedAttention | None,
                  ) -> SlidingLayer:
    """The cache layer of sliding layer ``layer`` of ``plan``: its window from the plan's fingerprint; its limit
    the ``sliding_kept`` share of ``window - 1`` (capacity mode: of what the plan priced it at,
    ``fp.layer_tokens(layer, plan.context_length)``)."""
    fp, cfg = plan.fingerprint, plan.layers[layer]
    tokens = fp.sliding_window - 1
    if budget_mode == BudgetMode.CAPACITY:
        tokens = fp.layer_tokens(layer, plan.context_length)
    limit = max(sliding_kept(tokens, cfg.keep_ratio), 1)
    ring = LayerConfig(1.0, cfg.k_bits, cfg.v_bits)
    budget = SlidingBudget(ring, limit, plan.context_length, fp.num_kv_heads, fp.head_dim, plan.group_size)
    return SlidingLayer(cfg, layer_idx=layer, window=fp.sliding_window, limit=limit, budget=budget,
                        group_size=plan.group_size, attention_fn=attention_fn)
