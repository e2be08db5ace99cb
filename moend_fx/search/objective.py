"""The measured objective of a plan search: teacher-forced continuation KL against the full cache.

Each held-out sequence is prefilled once at full precision
(:class:`moend_fx.calibration.continuation.ContinuationKL`: its per-layer K/V, eviction scores and the full
cache's next-token distributions), so a trial costs only what the
plan changes: compressing each layer's context as the cache does and running the continuation tokens against
it. Measured loss = mean over sequences of the mean over continuation positions of KL(p_full || p_plan), the
quantity ``moend bench proxy`` correlates the table's predicted loss with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moend_fx.calibration.continuation import ContinuationKL
from moend_fx.calibration.data import token_sequences
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.checks import check_int
from moend_fx.common.defaults import CALIBRATION_TOKENS
from moend_fx.plan.routing import LayerConfig

# The proxy validation's capture window (its ProxySettings.window): the queries the scorer statistics see.
CAPTURE_WINDOW = 64


@dataclass(frozen=True)
class HeldOutText:
    """Which text a search measures on: ``search`` sequences to search on, then ``check`` more (disjoint: the
    sequences after them in the same seeded held-out split) to re-measure the winners on. Each sequence is a
    context of ``tokens`` tokens followed by ``continuation`` teacher-forced tokens."""

    search: int = 4
    check: int = 4
    tokens: int = CALIBRATION_TOKENS
    continuation: int = 64
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("search", "tokens", "continuation"):
            check_int(name, getattr(self, name))
        check_int("check", self.check, minimum=0)
        check_int("seed", self.seed, minimum=0)

    def to_dict(self) -> dict[str, int]:
        return {"search": self.search, "check": self.check, "tokens": self.tokens,
                "continuation": self.continuation, "seed": self.seed}


class MeasuredKL:
    """Mean continuation KL of a plan over a fixed set of prefilled held-out sequences.

    Results are memoised by plan (a plan proposed twice is measured once in this process).
    """

    def __init__(self, model: Any, table: SensitivityTable, ids: torch.Tensor, context: int, *,
                 progress: Callable[[int, int], None] | None = None) -> None:
        """ids: [N, context + continuation] token ids; each row is prefilled once here."""
        self.table = table
        self.configs = table.grid.configs
        self.sequences: list[ContinuationKL] = []
        t0 = time.perf_counter()
        for i in range(ids.shape[0]):
            self.sequences.append(ContinuationKL(model, table, ids[i], context, CAPTURE_WINDOW))
            if progress is not None:
                progress(i + 1, ids.shape[0])
        self.prefill_s = time.perf_counter() - t0
        self._memo: dict[tuple[int, ...], list[float]] = {}

    def per_sequence(self, indices: Sequence[int]) -> list[float]:
        """KL of the plan with config indices ``indices`` (one per layer) on each sequence."""
        key = tuple(int(i) for i in indices)
        if key not in self._memo:
            layers: tuple[LayerConfig, ...] = tuple(self.configs[i] for i in key)
            self._memo[key] = [s.kl(layers) for s in self.sequences]
        return self._memo[key]

    def __call__(self, indices: Sequence[int]) -> float:
        return float(np.mean(self.per_sequence(indices)))


def held_out_objectives(model: Any, tokenizer: Any | None, table: SensitivityTable, text: HeldOutText, *,
                        check: bool = True, progress: Callable[[int, int], None] | None = None,
                        ) -> tuple[MeasuredKL, MeasuredKL | None, dict[str, Any]]:
    """(the search set's objective, the check set's (None if ``check`` is False or ``text.check`` is 0), the
    text's source record). Rows ``0 .. search-1`` of the held-out split are searched on, the next ``check``
    rows only re-measured."""
    n_check = text.check if check else 0
    ids, source = token_sequences(model, tokenizer, text.search + n_check, text.tokens + text.continuation,
                                  seed=text.seed, split="heldout")
    total = text.search + n_check
    search = MeasuredKL(model, table, ids[: text.search], text.tokens,
                        progress=None if progress is None else (lambda i, n: progress(i, total)))
    held = MeasuredKL(model, table, ids[text.search:], text.tokens,
                      progress=None if progress is None else (lambda i, n: progress(text.search + i, total))
                      ) if n_check else None
    return search, held, source
