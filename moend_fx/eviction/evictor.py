"""What a compressed cache layer evicts: :class:`Evictor` (policy, byte budget, scorer, query window, RoPE offsets).
Eviction is eager code (row loops, ``.tolist()``, data-dependent sizes), never inside a compiled decode step: there
the layer calls :meth:`Evictor.defer` and :meth:`MoENDCache.before_step` runs :meth:`Evictor.finish_deferred` before
the next step (``docs/cache.md``); both orders give the same cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.capacity import LayerBudget
from moend_fx.eviction.groups import groups_to_keep
from moend_fx.eviction.held import DenseKV, RealTokens, evict_rows, real_at, real_row_scores
from moend_fx.eviction.policy import EvictionPolicy
from moend_fx.eviction.query_window import QueryWindow
from moend_fx.eviction.scorers.base import Scorer
from moend_fx.eviction.selection import select_tokens, token_ranks
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV, slot_positions
from moend_fx.storage.tokens import gather_tokens


class Evictor:
    """Evicts one layer's tokens: ``policy`` says when and how far, ``scorer`` which tokens (None for a layer
    that keeps every token). Holds the scorer's :class:`QueryWindow` and ``rope_offset`` [B] (slot - RoPE
    position per row: nonzero under left padding), which :meth:`observe` keeps up to date, and counts the decode
    steps (``decode_steps``) the policy paces re-evictions by.

    budget: the layer's memory model (``capacity`` mode holds the layer to :meth:`LayerBudget.cap`); spare: what
    builds the scorer a layer that keeps every token starts evicting with when it outgrows that cap."""

    def __init__(self, config: LayerConfig, group_size: int, policy: EvictionPolicy, scorer: Scorer | None, *,
                 layer_idx: int, budget: LayerBudget | None = None,
                 spare: Callable[[], Scorer] | None = None) -> None:
        if config.evicts and scorer is None:
            raise MoendError(f"layer {layer_idx} ({config.name}) evicts tokens, so it needs a scorer")
        if policy.capped and budget is None:
            raise MoendError(f"layer {layer_idx}: budget_mode='capacity' needs the layer's LayerBudget")
        self.config, self.group_size, self.policy, self.budget = config, group_size, policy, budget
        self.layer_idx, self._scorers = layer_idx, (scorer, spare)
        self.clear()

    def clear(self) -> None:
        self.scorer: Scorer | None = self._scorers[0]
        self.evicting = self.config.evicts  # a keep-1.0 layer starts evicting when it outgrows its cap
        self.window = QueryWindow(self.policy.window)
        self.rope_offset: torch.Tensor | None = None
        self.evictions = self.decode_steps = 0
        self.queries_seen = 0  # queries observed while evicting (what the window's bytes follow)
        # capacity mode: decode steps until the next fit check; tokens a check must leave room for (make_room)
        self._check_in = self._room = 0
        # (True, the step's mask [B, 1, 1, S] or None) while a compiled step's count and eviction wait, else False
        self._deferred: tuple[bool, torch.Tensor | None] = (False, None)

    @property
    def needs_queries(self) -> bool:  # whether the scorer reads queries (then observe keeps a window of them)
        return self.scorer is not None and self.scorer.needs_queries

    # ------------------------------------------------------------------ state the scorer reads
    def observe(self, q: torch.Tensor, logical: int, position_ids: torch.Tensor | None) -> None:
        """After attention of the newest queries q: [B, H, L, D] (the layer now holds ``logical`` slots): record
        each row's RoPE offset from position_ids [B, L'] (None: unchanged, zeros at first); push q to the window
        when the scorer reads queries (a decode step's only if it re-reads them: ``Scorer.decode_queries``)."""
        if not self.evicting:
            return  # a layer that keeps every token never scores: it keeps neither offsets nor queries
        b, _, n_q, _ = q.shape
        if n_q > 1:  # a decode step's one query is counted by decode_step, outside any compiled graph
            self.queries_seen += n_q
        slots = torch.arange(logical - n_q, logical, device=q.device)
        if position_ids is not None:
            pid = position_ids.to(q.device).long().expand(b, -1)[:, -n_q:]
            self.rope_offset = slots[-1] - pid[:, -1]
        elif self.rope_offset is None:
            self.rope_offset = torch.zeros(b, dtype=torch.long, device=q.device)
        if self.needs_queries and (n_q > 1 or self.scorer.decode_queries):
            if n_q == 1 and torch.compiler.is_compiling():
                self.window.hold(q)  # pushed by finish_deferred: see QueryWindow.hold
            else:
                self.window.push(q, slots, slots[None, :] - self.rope_offset[:, None])

    def unpadded(self, batch: int, device: torch.device, tokens: int) -> None:
        """A prompt of ``tokens`` tokens loaded without its queries: unpadded rows, every slot its RoPE position."""
        if self.evicting:
            self.rope_offset = torch.zeros(batch, dtype=torch.long, device=device)
            self.queries_seen = tokens

    def index_batch(self, index: torch.Tensor) -> None:  # keep batch rows index [B'] of window and offsets
        self.window.index_batch(index)
        if self.rope_offset is not None:
            self.rope_offset = self.rope_offset.index_select(0, index.to(self.rope_offset.device))

    def tensors(self) -> list[torch.Tensor]:  # scratch tensors with a token axis at dim 2 (the query window)
        return self.window.tensors()

    def nbytes(self) -> int:
        """Bytes of the query window, the RoPE offsets and the scorer's tensors (``scorer_state_bytes`` predicts)."""
        offsets = 0 if self.rope_offset is None else self.rope_offset.numel() * self.rope_offset.element_size()
        scorer = 0 if self.scorer is None else self.scorer.nbytes()
        return self.window.nbytes() + offsets + scorer

    # ------------------------------------------------------------------ eviction
    def decode_step(self, packed: PackedKV, lmask: torch.Tensor | None, logical: int) -> PackedKV:
        """Count one decode step, then :meth:`evict` (the policy's cadence decides whether it is due)."""
        self.decode_steps += 1
        self.queries_seen += int(self.evicting)  # the step's query, which observe pushed if evicting
        return self.evict(packed, lmask, chunk=False, logical=logical)

    def defer(self, lmask: torch.Tensor | None) -> None:  # a compiled step: finish_deferred counts and evicts
        self._deferred = (True, lmask)

    deferred = property(lambda self: self._deferred[0])

    @torch.compiler.disable
    def finish_deferred(self, packed: PackedKV, logical: int) -> PackedKV:
        """The deferred step's :meth:`decode_step`, with its mask (its query joins the window first)."""
        lmask, self._deferred = self._deferred[1], (False, None)
        self.window.push_held(logical - 1, self.rope_offset)
        return self.decode_step(packed, lmask, logical)

    def evict(self, kv: PackedKV | DenseKV, lmask: torch.Tensor | None, *, chunk: bool, logical: int) -> PackedKV:
        """The layer's storage after evicting when the policy (or, in capacity mode, the byte cap) says so:
        ``kv`` itself (a PackedKV) when nothing is due; a DenseKV is always compressed (evicted or not), so a
        prompt is quantized once, from exact K/V. After a prompt (or chunk) the query window is dropped when the
        scorer reads no queries at decode time (``Scorer.decode_queries``).

        lmask: the step's bool mask [B, 1, L, S=logical] or None; chunk: after a prompt or a prefill chunk (else
        after decode step ``decode_steps``)."""
        out = self._evict(kv, lmask, chunk=chunk, logical=logical)
        if chunk and self.scorer is not None and not self.scorer.decode_queries:
            self.window = QueryWindow(self.policy.window)
        return out

    def _evict(self, kv: PackedKV | DenseKV, lmask: torch.Tensor | None, *, chunk: bool, logical: int) -> PackedKV:
        dense = isinstance(kv, DenseKV)
        capped = self.policy.capped and self._over_cap(kv, logical, chunk)
        if not self.evicting:
            if not capped:
                return self._pack(kv, lmask) if dense else kv
            kv = self._start_evicting(kv, lmask, logical)
        n = kv.keys.shape[2] if dense else kv.num_tokens
        pos = kv.positions.long()
        real = RealTokens.of(pos, lmask, logical)
        targets = self.policy.targets(n, real.seen, real.held, keep_ratio=self.config.keep_ratio,
                                      decode_steps=self.decode_steps, chunk=chunk)
        groups = not dense and not chunk and self._has_groups(kv)
        if capped:
            targets = self._capped(kv, targets, logical, groups)
        elif groups and targets is not None:
            # by the ratio, whole groups only while a whole group is over it (held stays < G over the ratio)
            drop = (n - int(targets.max())) // self.group_size
            targets = None if drop == 0 else torch.full_like(targets, n - drop * self.group_size)
        if targets is None:  # a packed layer that evicted nothing keeps its countdown (_over_cap set it)
            return self._after(self._pack(kv, lmask), logical) if dense else kv
        if groups and self._by_groups(kv, int(targets.max())):
            out = self._evict_groups(kv, pos, real, int(targets.max()))
        else:
            out = self._evict_tokens(kv, pos, real, targets, lmask)
        self.evictions += 1
        return self._after(out, logical)

    # ------------------------------------------------------------------ capacity mode
    def _shape(self, kv: PackedKV | DenseKV) -> tuple[int, int, torch.dtype]:  # (held tokens, batch, model dtype)
        if isinstance(kv, DenseKV):
            return kv.keys.shape[2], kv.keys.shape[0], kv.keys.dtype
        return kv.num_tokens, kv.k_res.shape[0], kv.dtype

    def _over_cap(self, kv: PackedKV | DenseKV, logical: int, chunk: bool) -> bool:
        """Whether the layer must evict to keep the next token within its byte cap (a countdown between checks:
        each check says how many more tokens fit)."""
        need = max(self._room, self.policy.reserve + 1)  # the next token and the reserve, or make_room's tokens
        if not chunk and self._check_in > need:
            self._check_in -= 1
            return False
        n, batch, dtype = self._shape(kv)
        ahead = self.budget.steps_that_fit(n, logical, self.queries_seen, batch=batch, dtype=dtype,
                                           evicting=self.evicting)
        self._check_in = ahead
        if ahead < need or not chunk:
            return ahead < need
        held = self.budget.held(n, logical, self.queries_seen, batch=batch, dtype=dtype, evicting=self.evicting)
        return held > self.budget.cap(batch=batch, dtype=dtype)  # a prompt longer than the plan's

    def _capped(self, kv: PackedKV | DenseKV, targets: torch.Tensor | None, logical: int, groups: bool) -> torch.Tensor:
        """Per-row targets [B] lowered to what the byte cap holds with room for the next tokens (by whole packed
        groups when ``groups``, if that can reach it)."""
        n, batch, dtype = self._shape(kv)
        room = self._room or max(self.policy.room(self.group_size), self.policy.reserve + 1)  # make_room: its own
        limit = n if targets is None else int(targets.max())
        kw = dict(batch=batch, dtype=dtype, room=room, strict=self._room > 0, need=self.policy.reserve + 1)
        m = self.budget.target([n - d * self.group_size for d in reversed(range(kv.num_groups + 1))], logical,
                               self.queries_seen, **kw) if groups else None
        m = None if m is None or m > limit else m
        if m is None:
            m = self.budget.target(range(1, limit + 1), logical, self.queries_seen, **kw)
        if m is None and kw["need"] + self._room > 1:  # none leaves the room or reserve: what fits the next token
            m = self.budget.target(range(1, limit + 1), logical, self.queries_seen, **kw | dict(strict=False, need=1))
        if m is None:
            self.budget.check_fits_one(logical, self.queries_seen, batch=batch, dtype=dtype,
                                       layer_idx=self.layer_idx)
            m = 1
        t = torch.full((batch,), min(m, limit), dtype=torch.long)
        return t if targets is None else torch.minimum(targets, t)

    def _after(self, packed: PackedKV, logical: int) -> PackedKV:
        """After a compression or an eviction in capacity mode: how many tokens fit before the next check."""
        if self.policy.capped:
            self._check_in = self.budget.steps_that_fit(packed.num_tokens, logical, self.queries_seen,
                                                        batch=packed.k_res.shape[0], dtype=packed.dtype,
                                                        evicting=self.evicting)
        return packed

    def make_room(self, packed: PackedKV, logical: int, tokens: int) -> PackedKV:
        """Capacity mode, between steps: evict by the byte cap so that ``tokens`` more fit (a speculative step's,
        open until its crop: ``moend_fx.cache.speculation``); ``packed`` itself when they fit or no cap applies."""
        if not self.policy.capped or self._check_in >= tokens:  # the countdown says they fit
            return packed
        self._room, self._check_in = tokens, 0  # _over_cap checks now, for ``tokens`` ahead
        out, self._room = self.evict(packed, None, chunk=False, logical=logical), 0
        return out

    def start(self, packed: PackedKV, logical: int) -> PackedKV:
        """Start evicting now (capacity mode, between steps), evicting at once if the positions leave no room."""
        kv = self._start_evicting(packed, None, logical)
        self._check_in = 0
        return self.evict(kv, None, chunk=False, logical=logical)

    def _start_evicting(self, kv: PackedKV | DenseKV, lmask: torch.Tensor | None, logical: int,
                        ) -> PackedKV | DenseKV:
        """A layer that kept every token outgrew its cap: from now on it stores positions (token i is at slot i,
        nothing having been evicted) and evicts with the spare scorer. Its rows' RoPE offsets are their
        left-padding, the slots their mask hides."""
        if self._scorers[1] is None:
            raise MoendError(f"layer {self.layer_idx} ({self.config.name}) outgrew its byte budget and has no "
                             "scorer to evict with")
        self.evicting, self.scorer = True, self._scorers[1]()
        n, batch, _ = self._shape(kv)
        like = kv.keys if isinstance(kv, DenseKV) else kv.k_res
        pos = slot_positions(0, n, like)
        seen = torch.full((batch,), logical) if lmask is None else lmask[:, 0, -1, :].sum(-1).cpu()
        self.rope_offset = (logical - seen).long().to(like.device)
        return kv._replace(positions=pos) if isinstance(kv, DenseKV) else kv.with_positions(pos)

    # ------------------------------------------------------------------ how
    def _has_groups(self, kv: PackedKV) -> bool:
        """Whether a re-eviction of ``kv`` drops whole packed groups: the policy says so (``reevict="groups"``), its K
        is quantized (regrouping survivors would re-quantize them) and it has packed groups."""
        return self.policy.whole_groups and self.config.k_bits < 16 and kv.num_groups > 0

    def _by_groups(self, kv: PackedKV, target: int) -> bool:  # drops whole groups and reaches ``target`` that way
        return self._has_groups(kv) and -(-(kv.num_tokens - target) // self.group_size) <= kv.num_groups

    def _evict_groups(self, kv: PackedKV, pos: torch.Tensor, real: RealTokens, target: int) -> PackedKV:
        """Drop the fewest whole packed groups that bring the layer to ``target`` tokens or below."""
        k, v = kv.dequantize()
        scores = (self.scores(k, v, pos, None, None) if real.valid is None
                  else real_row_scores(k, v, pos, real.valid, self.scores))
        ranks = token_ranks(scores, sink_tokens=self.policy.sink_tokens, recent_tokens=self.policy.recent_tokens,
                            key_positions=pos)
        drop = -(-(kv.num_tokens - target) // self.group_size)
        return kv.keep_groups(groups_to_keep(ranks, kv.num_packed, self.group_size, drop))

    def _evict_tokens(self, kv: PackedKV | DenseKV, pos: torch.Tensor, real: RealTokens, targets: torch.Tensor,
                      lmask: torch.Tensor | None) -> PackedKV:
        """Token-by-token eviction (a prompt on exact K/V; a packed layer with 16-bit K, or one whose groups
        cannot reach the target, is dequantized and quantized again)."""
        k, v = (kv.keys, kv.values) if isinstance(kv, DenseKV) else kv.dequantize()
        if real.valid is None and bool((targets == targets[0]).all()):
            idx = self._select(k, v, pos, int(targets[0]))
            k, v, pos = gather_tokens(k, idx), gather_tokens(v, idx), gather_tokens(pos, idx)
        else:
            k, v, pos = evict_rows(k, v, pos, real, targets, self._select, self.window.slots)
        return PackedKV.from_dense(k, v, self.config, self.group_size, pos, valid=real_at(lmask, pos))

    def _pack(self, kv: DenseKV, lmask: torch.Tensor | None) -> PackedKV:  # nothing evicted; pads out of min/max
        slots = kv.positions if kv.positions is not None else slot_positions(0, kv.keys.shape[2], kv.keys)
        valid = real_at(lmask, slots.long())
        return PackedKV.from_dense(kv.keys, kv.values, self.config, self.group_size, kv.positions, valid=valid)

    def scores(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, row: int | None,
                q_keep: torch.Tensor | None) -> torch.Tensor:
        """Scores [b, Hkv, n] of k, v: [b, Hkv, n, D] at slots pos [b, Hkv, n] (b = 1 when ``row``). A scorer
        that reads queries but has none yet (a keep-1.0 layer that has just started evicting) scores every token
        alike, so selection keeps the sinks and the most recent tokens (StreamingLLM) until it has some."""
        q, qpos = self.window.select(row, q_keep)
        if q is None and self.scorer.decode_queries:
            return torch.zeros(pos.shape, device=k.device)
        one = slice(None) if row is None else slice(row, row + 1)
        rope_pos = (pos - self.rope_offset[one].to(pos.device)[:, None, None]).clamp_min(0)
        return self.scorer.score(k, v, queries=q, key_positions=rope_pos, query_positions=qpos)

    def _select(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n_keep: int,
                row: int | None = None, q_keep: torch.Tensor | None = None) -> torch.Tensor:
        """Indices [b, Hkv, n_keep] of the tokens to keep among k, v: [b, Hkv, n, D] (b = 1 when ``row``);
        pos: [b, Hkv, n] slots. q_keep: [W] bool, which window queries of ``row`` are real tokens (None = all)."""
        scores = self.scores(k, v, pos, row, q_keep)
        idx, _ = select_tokens(scores, n_keep, sink_tokens=self.policy.sink_tokens,
                               recent_tokens=self.policy.recent_tokens, key_positions=pos)
        return idx
