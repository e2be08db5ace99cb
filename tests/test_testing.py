"""moend_fx.testing: the strategies and the reference check a kernel author imports (docs/kernel-testing.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings

from moend_fx.kernels import cpu, packed_attention
from moend_fx.testing import DecodeCase, assert_matches_reference, decode_cases


@settings(max_examples=15, deadline=None)
@given(decode_cases())
def test_the_shipped_kernel_passes_the_check(case: DecodeCase):
    assert cpu.available(), cpu.build_error()  # else "auto" is the reference itself and this proves nothing
    assert case.tokens >= 1 and case.q.abs().sum() > 0  # never an empty layer or a zero query
    assert_matches_reference(packed_attention(case.q, case.layer, kernel="auto"), case)


@settings(max_examples=10, deadline=None)
@given(decode_cases(max_groups=2))
def test_the_check_catches_a_kernel_that_drops_the_newest_token(case: DecodeCase):
    """A kernel that forgets the last token (an off-by-one a variant can have) fails the check: the check has
    teeth. A layer of one token has nothing left after the drop, so those draws are rejected."""
    assume(case.tokens >= 2)
    k, v = case.layer.dequantize(torch.float32)
    d = case.q.shape[-1]
    g = case.q.shape[1] // k.shape[1]
    kk, vv = k[:, :, :-1].repeat_interleave(g, 1), v[:, :, :-1].repeat_interleave(g, 1)
    wrong = torch.softmax(case.q @ kk.transpose(-1, -2) / d**0.5, -1) @ vv
    with pytest.raises(AssertionError):
        assert_matches_reference(wrong.to(case.q.dtype), case)
