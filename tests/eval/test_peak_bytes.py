"""PeakBytes with greedy_decode: the most a cache held over the question and answer (tiny random model)."""

from __future__ import annotations

import pytest

from moend_fx.eval.methods import METHODS, build_cache, cache_nbytes
from moend_fx.eval.peak_bytes import PeakBytes
from moend_fx.eval.plan_book import PlanBook
from moend_fx.eval.steps import EVAL_ATTN, greedy_decode, prefill
from moend_fx.eval.tasks.registry import make_examples
from tests.eval.test_runner import TOK, _ids


@pytest.fixture(scope="module")
def example():
    return make_examples("passkey", TOK, 360, n=1, seed=3)[0]


def test_peak_bytes_track_the_most_a_cache_held_over_the_decode(model, table, example):
    """greedy_decode calls after_step after every forward pass (the suffix, then each fed token), and PeakBytes
    keeps the largest measurement: a capacity-mode cache fills the room it left after the prompt, up to its cap."""
    ctx, suffix = _ids(example, "query_agnostic")
    model.set_attn_implementation(EVAL_ATTN)
    try:
        state = prefill(model, ctx)
        entry = PlanBook(table).get("2d_uniform", "4x", state.length)
        cache = build_cache(METHODS["2d_uniform"], state, model=model, plan=entry.plan, scorer="snapkv")
        peak, seen = PeakBytes(cache), []
        assert peak.after_prompt == peak.bytes == cache_nbytes(cache)

        def step() -> None:
            peak.update()
            seen.append(cache_nbytes(cache))

        new, why = greedy_decode(model, cache, suffix, 40, after_step=step)
    finally:
        model.set_attn_implementation("sdpa")
    assert why == "max_new_tokens" and len(seen) == 40  # the suffix's pass and 39 fed tokens
    assert peak.bytes == max([peak.after_prompt, *seen]) > peak.after_prompt
    assert peak.bytes <= cache.budget_bytes().total
