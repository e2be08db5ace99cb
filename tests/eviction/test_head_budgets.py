"""Per-KV-head counts (Ada-KV style): totals, floors, prefixes of each head's priority, and who wins tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eviction.head_budgets import head_counts, keep_mask
from moend_fx.eviction.selection import select_tokens
from tests.eviction.scorers.helpers import gen


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 4), t=st.integers(40, 120), frac=st.floats(0.05, 1.0),
       alpha=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_counts_sum_to_the_layer_total_and_respect_the_floor(b, hkv, t, frac, alpha, seed):
    g = gen(seed)
    # heads of different sharpness, so counts really differ
    scores = torch.randn(b, hkv, t, generator=g) * torch.rand(1, hkv, 1, generator=g).mul(4).add(0.1)
    n = max(1, min(t, int(frac * t)))
    counts = head_counts(scores, n, alpha=alpha, sink_tokens=4, recent_tokens=8)
    assert counts.shape == (b, hkv) and counts.dtype == torch.int64
    assert (counts.sum(-1) == n * hkv).all()
    floor = min(n, max(math.ceil(alpha * n), 12))
    assert (counts >= floor).all() and (counts <= t).all()
    # every head keeps a prefix of its own priority order: what select_tokens keeps with its count
    mask = keep_mask(scores, counts, sink_tokens=4, recent_tokens=8)
    assert (mask.sum(-1) == counts).all()
    for i in range(b):
        for h in range(hkv):
            idx, _ = select_tokens(scores[i:i + 1, h:h + 1], int(counts[i, h]), sink_tokens=4, recent_tokens=8)
            assert mask[i, h].nonzero().flatten().tolist() == idx.flatten().tolist()


def test_heads_with_the_same_scores_keep_the_uniform_count():
    s = torch.randn(1, 1, 64, generator=gen(1)).expand(2, 3, 64)
    assert head_counts(s, 20, sink_tokens=2, recent_tokens=4).tolist() == [[20, 20, 20]] * 2
    # the uniform mask is select_tokens' selection
    mask = keep_mask(s, torch.full((3,), 20), sink_tokens=2, recent_tokens=4)
    idx, _ = select_tokens(s, 20, sink_tokens=2, recent_tokens=4)
    assert torch.equal(mask, torch.zeros_like(mask).scatter_(2, idx, True))


def test_a_head_that_looks_something_up_wins_the_tokens_a_broad_head_would_keep():
    # head 0: 12 "needle" tokens far above its flat rest; heads 1 and 2: broad noise. At 6 tokens a head, the
    # uniform split drops half of the needle; per-head counts keep all of it, from the broad heads' share.
    t, n = 80, 6
    s = torch.randn(1, 3, t, generator=gen(2)) * 0.1
    needle = torch.arange(30, 42)
    s[0, 0, needle] = 10.0
    counts = head_counts(s, n, alpha=0.0, sink_tokens=0, recent_tokens=0)
    assert int(counts[0, 0]) >= len(needle) and int(counts.sum()) == 3 * n
    kept = keep_mask(s, counts, sink_tokens=0, recent_tokens=0)[0, 0]
    assert kept[needle].all()
    uniform = keep_mask(s, torch.full((3,), n), sink_tokens=0, recent_tokens=0)[0, 0]
    assert int(uniform[needle].sum()) == n
    # the safeguard share: with alpha = 1 every head keeps the uniform count again
    assert head_counts(s, n, alpha=1.0, sink_tokens=0, recent_tokens=0).tolist() == [[n, n, n]]


def test_masked_tokens_go_last_in_every_head():
    s = torch.randn(1, 2, 30, generator=gen(3))
    s[0, 1, :20] = -math.inf  # head 1 has only 10 real tokens
    counts = head_counts(s, 8, alpha=0.0, sink_tokens=0, recent_tokens=0)
    mask = keep_mask(s, counts, sink_tokens=0, recent_tokens=0)
    assert int(counts.sum()) == 16
    assert not mask[0, 1, :20].any() or bool(mask[0, 1, 20:].all())  # -inf only once every real token is kept


@pytest.mark.parametrize("kw, match", [
    (dict(n_keep=0), "n_keep=0"),
    (dict(n_keep=11), r"n_keep=11.*\[1, T=10\]"),
    (dict(n_keep=True), "n_keep=True"),
    (dict(n_keep=3, alpha=1.5), r"alpha=1.5.*\[0, 1\]"),
    (dict(n_keep=3, alpha=True), "alpha=True"),
])
def test_bad_arguments_are_clear_errors(kw, match):
    s = torch.randn(1, 2, 10, generator=gen(4))
    with pytest.raises(MoendError, match=match):
        head_counts(s, **kw)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(MoendError, match=r"\[B, Hkv, T\]"):
        head_counts(torch.randn(2, 10), 3)
    with pytest.raises(MoendError, match=r"counts \(2, 3\) must be \[B, Hkv\] = \(1, 2\)"):
        keep_mask(torch.randn(1, 2, 10), torch.ones(2, 3, dtype=torch.long))
