"""The most bytes a cache holds while it answers: the figure a budget must hold (docs/evaluation.md, "Memory")."""

from __future__ import annotations

from typing import Any

from moend_fx.eval.methods import cache_nbytes

__all__ = ["PeakBytes"]


class PeakBytes:
    """The most bytes a cache has held: measured at construction (after the prompt) and at each
    :meth:`update` (pass it to ``greedy_decode(after_step=...)``, which calls it after every forward pass).

    Why both: after the prompt a capacity-mode MoENDCache has left room for the next tokens (each layer keeps
    fewer than its cap allows, so eviction reruns every ``room`` tokens, not at every one), and the question and
    answer then fill it; an HF cache grows with them. The peak is what a budget must hold."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.after_prompt = cache_nbytes(cache)
        self.bytes = self.after_prompt

    def update(self) -> None:
        self.bytes = max(self.bytes, cache_nbytes(self.cache))
