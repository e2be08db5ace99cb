"""EvictionPolicy: when an eviction is due and to how many tokens; its options."""

from __future__ import annotations

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.common.options import BudgetMode
from moend_fx.eviction.policy import EvictionPolicy
from moend_fx.plan.memory import keep_count


def _targets(policy, n, seen, held, steps=0, chunk=False, keep=0.5):
    return policy.targets(n, torch.tensor(seen), torch.tensor(held), keep_ratio=keep, decode_steps=steps,
                          chunk=chunk)


def test_ratio_mode_evicts_after_a_chunk_and_every_evict_every_steps():
    pol = EvictionPolicy(evict_every=4, sink_tokens=1, recent_tokens=3)
    assert pol.budget_mode is BudgetMode.RATIO and pol.floor == 4
    want = [keep_count(100, 0.5, 4), keep_count(80, 0.5, 4)]
    assert _targets(pol, 100, [100, 80], [100, 80], chunk=True).tolist() == want
    assert _targets(pol, 100, [100, 80], [100, 80], steps=3) is None  # not a multiple of evict_every
    assert _targets(pol, 100, [100, 80], [100, 80], steps=8).tolist() == want
    assert _targets(pol, 100, [100, 80], [30, 20], chunk=True).tolist() == [30, 20]  # never more than held
    assert _targets(pol, 6, [6], [6], chunk=True, keep=1.0) is None  # nothing to drop


def test_capacity_mode_evicts_by_ratio_after_a_prompt_only():
    """Its byte cap is the evictor's (tests/eviction/test_capacity.py); the ratio applies to a prompt or chunk."""
    pol = EvictionPolicy("capacity", evict_every=8, sink_tokens=1, recent_tokens=3)
    assert pol.capped and pol.room(32) == 8 and EvictionPolicy("capacity", evict_every=128).room(32) == 32
    assert _targets(pol, 100, [100], [100], chunk=True).tolist() == [keep_count(100, 0.5, 4)]
    assert _targets(pol, 100, [100], [100], steps=8) is None


def test_options_are_checked():
    with pytest.raises(MoendError, match="budget_mode='fixed' is unknown; allowed: ratio, capacity"):
        EvictionPolicy("fixed")
    with pytest.raises(MoendError, match="evict_every=0"):
        EvictionPolicy(evict_every=0)
    with pytest.raises(MoendError, match="window=0"):
        EvictionPolicy(window=0)
    with pytest.raises(MoendError, match="reevict='some' is unknown; allowed: groups, tokens"):
        EvictionPolicy(reevict="some")
    assert EvictionPolicy().whole_groups and not EvictionPolicy(reevict="tokens").whole_groups
