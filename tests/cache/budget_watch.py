"""Test helpers that read a generate cache's measured bytes after every forward pass, so a test can assert that a
budget holds at every step (not only at the end)."""

from __future__ import annotations

from typing import Any

from transformers import LogitsProcessor

from moend_fx.cache import generation


class BytesEveryStep(LogitsProcessor):
    """A logits processor that records ``cache.nbytes().total`` after every forward pass (the prompt's and each
    decode step's). source: the cache itself, or the list :func:`record_caches` fills (its newest cache is read)."""

    def __init__(self, source: Any) -> None:
        self.source, self.seen = source, []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        cache = self.source[-1] if isinstance(self.source, list) else self.source
        self.seen.append(cache.nbytes().total)
        return scores


def record_caches(monkeypatch: Any) -> list:
    """Make every MoENDCache that a prepared model's ``generate`` builds append itself to the returned list."""
    made: list = []

    class Recording(generation.MoENDCache):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(generation, "MoENDCache", Recording)
    return made
