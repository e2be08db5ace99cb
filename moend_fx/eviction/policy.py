"""When and how a compressed cache layer evicts tokens: :class:`EvictionPolicy` and the :class:`Evicting`
mixin of :class:`moend_fx.cache.layer.MoENDLayer`.

Eviction is plain eager code (Python loops over rows, ``.tolist()``, data-dependent sizes): it never runs
inside a compiled decode step. The layer calls :meth:`Evicting._maybe_evict` after a prompt (or a chunk) and,
during decode, either right after the step's attention (eager) or, when that attention ran inside a
``torch.compile`` graph, from :meth:`MoENDCache.before_step` before the next step (see ``docs/cache.md``).
Both orders give the same cache: nothing reads or writes it between the end of one step and the next update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.scoring import select_tokens
from moend_fx.plan.memory import keep_count
from moend_fx.storage.packed import PackedKV

BUDGET_MODES = ("ratio", "capacity")


@dataclass(frozen=True)
class EvictionPolicy:
    """When and how far a layer evicts.

    ratio: after the prompt (and after each prefill chunk) keep ``keep_count(seen, keep_ratio, floor)``; during
    decode re-evict to that every ``evict_every`` steps (in between the held count grows by < evict_every).
    capacity: never hold more than ``cap`` tokens; when a new token would exceed it, evict down to
    ``max(cap - slack, min(floor, cap))`` (slack = min(evict_every - 1, cap // 2)) so eviction re-runs about
    every evict_every steps. ``seen`` counts a row's real (unmasked) tokens, so padding never earns a row extra
    tokens. ``floor`` = sink_tokens + recent_tokens: an evicting layer keeps at least that many (or all it has).
    """

    budget_mode: str = "ratio"
    evict_every: int = 128
    window: int = 32
    sink_tokens: int = 4
    recent_tokens: int = 32
    cap: int | None = None  # capacity mode: max(keep_count(plan.context_length, keep_ratio), floor)

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
    def floor(self) -> int:
        """The fewest tokens an eviction keeps (when there are that many): the sinks plus the recent window."""
        return self.sink_tokens + self.recent_tokens

    @property
    def low_water(self) -> int:
        assert self.cap is not None
        return max(1, self.cap - min(self.evict_every - 1, self.cap // 2), min(self.floor, self.cap))


class Evicting:
    """Eviction methods of a cache layer. The layer provides: ``config``, ``group_size``, ``policy``, ``scorer``,
    ``packed``, ``logical``, ``decode_steps``, ``evictions``, ``layer_idx``, ``_rope_offset`` and the scorer's
    query window (``_q_win``, ``_q_slots``, ``_q_pos``)."""

    def _targets(
        self, n: int, real_seen: torch.Tensor, real_held: torch.Tensor, chunk: bool
    ) -> torch.Tensor | None:
        """Per-row tokens to keep [B] out of the ``n`` held, or None when no eviction is due."""
        pol = self.policy
        if pol.budget_mode == "ratio":
            if not chunk and self.decode_steps % pol.evict_every:
                return None
            t = torch.tensor([keep_count(int(s), self.config.keep_ratio, pol.floor) for s in real_seen.tolist()])
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
