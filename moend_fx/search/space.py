"""Where a measured search looks: per-layer moves on the grid around the solvers' plans.

The table ranks a layer's configs by predicted loss; where it mis-ranks, the fix is a different config of
about the same bytes on that layer, or bytes moved from one layer to another. Both spaces move a layer's config
by up to ``radius`` places in the layer's order by (bytes, S) from a seed plan's (greedy's or exact's):

- :class:`Moves` (the default): a seed plan with two layers moved, an exchange of bytes between layers; a space
  small enough for a few hundred trials to cover.
- :class:`Neighbourhood`: every layer free within its neighbourhood at once (a categorical parameter per layer,
  ``l00``, ``l01``...): far larger, and most proposals move many layers away from the seed.

A proposal over budget is stepped down by bytes alone (:func:`moend_fx.solvers.optuna_search.repair_by_bytes`,
never looking at S or the measurement), so every measured plan is within the budget.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moend_fx.common.checks import check_int
from moend_fx.solvers.optuna_search import repair_by_bytes


def byte_order(S: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ranks [L, C]: each layer's configs sorted by (bytes, S, index), pos_of [L, C]: its inverse). S, B: [L, C]."""
    L, C = S.shape
    ranks = np.stack([np.lexsort((np.arange(C), S[l], B[l])) for l in range(L)])
    return ranks, np.argsort(ranks, axis=1)


@dataclass(frozen=True)
class _ByteSpace:
    """What both spaces share: each layer's byte order (:func:`byte_order`), the bytes B [L, C], the budget
    every proposal is repaired to and the radius of a move."""

    ranks: np.ndarray
    pos_of: np.ndarray
    B: np.ndarray
    budget: int
    radius: int

    def repair(self, idx: np.ndarray) -> np.ndarray:
        """idx: [L] config indices; the same plan stepped down by bytes until it fits."""
        return repair_by_bytes(np.asarray(idx), self.ranks, self.pos_of, self.B, self.budget)

    def bytes_of(self, idx: Sequence[int]) -> int:
        return int(self.B[np.arange(self.B.shape[0]), np.asarray(idx, dtype=np.int64)].sum())

    def _hash(self, what: Any) -> str:
        h = hashlib.sha256(repr((what, self.radius, self.budget)).encode())
        h.update(np.ascontiguousarray(self.B).tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class Neighbourhood(_ByteSpace):
    """Every layer free at once. candidates[l]: the config indices layer l may take (in its byte order)."""

    candidates: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def around(cls, seeds: Sequence[Sequence[int]], S: np.ndarray, B: np.ndarray, budget: int, radius: int,
               ) -> Neighbourhood:
        """seeds: plans (config indices [L] each) to search around. S: [L, C] predicted loss; B: [L, C] bytes."""
        check_int("radius", radius, minimum=0)
        ranks, pos_of = byte_order(S, B)
        L, C = S.shape
        cands = []
        for l in range(L):
            pos: set[int] = set()
            for seed in seeds:
                p = int(pos_of[l, int(seed[l])])
                pos.update(range(max(0, p - radius), min(C, p + radius + 1)))
            cands.append(tuple(int(ranks[l, p]) for p in sorted(pos)))
        return cls(ranks, pos_of, np.asarray(B, dtype=np.int64), int(budget), int(radius), tuple(cands))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"l{l:02d}" for l in range(len(self.candidates)))

    @property
    def size(self) -> float:
        """Number of plans in the space (before repair), as a float (it overflows int64 quickly)."""
        return float(np.prod([float(len(c)) for c in self.candidates]))

    def key(self) -> str:
        """Part of a study's problem key: a study must not be fed trials of another space."""
        return self._hash(self.candidates)

    def propose(self, trial: Any) -> np.ndarray:
        """[L] config indices of the trial's proposal, repaired to fit the budget."""
        idx = np.array([trial.suggest_categorical(n, list(c)) for n, c in zip(self.names, self.candidates)])
        return self.repair(idx)

    def params(self, idx: Sequence[int]) -> dict[str, int]:
        """The trial parameters proposing ``idx`` [L] (a seed plan, to enqueue)."""
        return {n: int(i) for n, i in zip(self.names, idx)}

    def seed_params(self, name: str, idx: Sequence[int]) -> dict[str, int]:
        return self.params(idx)


@dataclass(frozen=True)
class Moves(_ByteSpace):
    """The search space of exchanges: a trial takes one seed plan (``base``) and moves two layers ``a`` and ``b``
    by ``da`` and ``db`` places (in -radius..radius) in their byte order, then is repaired to the budget: one
    layer given more bytes and another fewer, the move greedy's choices are wrong about if the table mis-ranks
    them. A small space (seeds x L x (2r+1) x L x (2r+1) proposals) a few hundred trials can learn."""

    seeds: dict[str, tuple[int, ...]] | None = None

    @classmethod
    def around(cls, seeds: dict[str, Sequence[int]], S: np.ndarray, B: np.ndarray, budget: int, radius: int,
               ) -> Moves:
        """seeds: name -> plan (config indices [L]). S: [L, C] predicted loss; B: [L, C] bytes."""
        check_int("radius", radius)
        ranks, pos_of = byte_order(S, B)
        return cls(ranks, pos_of, np.asarray(B, dtype=np.int64), int(budget), int(radius),
                   {n: tuple(int(i) for i in s) for n, s in seeds.items()})

    @property
    def plans(self) -> dict[str, tuple[int, ...]]:
        return self.seeds or {}

    @property
    def num_layers(self) -> int:
        return self.B.shape[0]

    @property
    def candidates(self) -> tuple[tuple[int, ...], ...]:
        """The configs each layer can take in one move from any seed."""
        C = self.B.shape[1]
        out = []
        for l in range(self.num_layers):
            pos = {int(self.pos_of[l, s[l]]) + d for s in self.plans.values()
                   for d in range(-self.radius, self.radius + 1)}
            out.append(tuple(int(self.ranks[l, p]) for p in sorted(pos) if 0 <= p < C))
        return tuple(out)

    @property
    def size(self) -> float:
        side = float(self.num_layers * (2 * self.radius + 1))
        return len(self.plans) * side * side

    def key(self) -> str:
        return self._hash(("moves", sorted(self.plans.items())))

    def propose(self, trial: Any) -> np.ndarray:
        """[L] config indices: the trial's base plan with its two moves, repaired to fit the budget."""
        r, L, C = self.radius, self.num_layers, self.B.shape[1]
        idx = np.array(self.plans[trial.suggest_categorical("base", list(self.plans))])
        for layer, delta in (("a", "da"), ("b", "db")):
            l = trial.suggest_int(layer, 0, L - 1)
            p = int(np.clip(self.pos_of[l, idx[l]] + trial.suggest_int(delta, -r, r), 0, C - 1))
            idx[l] = self.ranks[l, p]
        return self.repair(idx)

    def seed_params(self, name: str, idx: Sequence[int]) -> dict[str, Any]:
        """The parameters that propose seed ``name`` unchanged."""
        return {"base": name, "a": 0, "da": 0, "b": 0, "db": 0}
