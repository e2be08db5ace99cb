"""The measured objective: one prefill per sequence, KL per plan, memoised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moend_fx.calibration.continuation import ContinuationKL
from moend_fx.calibration.data import token_sequences
from moend_fx.common.errors import MoendError
from moend_fx.search import HeldOutText, MeasuredKL
from moend_fx.search.objective import CAPTURE_WINDOW, held_out_objectives
from tests.search import helpers


@pytest.fixture(scope="module")
def parts():
    m = helpers.model()
    return m, helpers.table(m)


def test_mean_kl_is_the_mean_of_the_heldout_sequences_and_lossless_is_zero(parts):
    m, t = parts
    obj = helpers.objective(m, t)
    ids, _ = token_sequences(m, None, helpers.TEXT.search, helpers.TEXT.tokens + helpers.TEXT.continuation,
                             seed=helpers.TEXT.seed, split="heldout")
    configs = t.grid.configs
    rng = np.random.default_rng(0)
    idx = [int(rng.integers(0, len(configs))) for _ in range(t.num_layers)]
    layers = tuple(configs[i] for i in idx)
    direct = [ContinuationKL(m, t, ids[i], helpers.TEXT.tokens, CAPTURE_WINDOW).kl(layers)
              for i in range(ids.shape[0])]
    # the same computation on the same prefill: equal to float64 rounding of the mean
    assert obj(idx) == pytest.approx(float(np.mean(direct)), rel=1e-12, abs=0)
    lossless = t.grid.index(next(c for c in configs if c.lossless))
    assert obj([lossless] * t.num_layers) == 0.0
    heavy = t.grid.index(min(configs, key=lambda c: (c.keep_ratio, c.k_bits + c.v_bits)))
    assert obj([heavy] * t.num_layers) > 0.0


def test_a_plan_is_measured_once(parts, monkeypatch):
    m, t = parts
    obj = helpers.objective(m, t)
    calls = []
    orig = ContinuationKL.kl
    monkeypatch.setattr(ContinuationKL, "kl", lambda self, layers: calls.append(1) or orig(self, layers))
    a = obj([0] * t.num_layers)
    b = obj([0] * t.num_layers)
    assert a == b and len(calls) == helpers.TEXT.search


def test_check_set_is_disjoint_from_the_search_set(parts):
    m, t = parts
    search, held, _ = held_out_objectives(m, None, t, helpers.TEXT, check=True)
    assert held is not None and len(held.sequences) == helpers.TEXT.check
    a = torch.stack([s.cont[0] for s in search.sequences])
    b = torch.stack([s.cont[0] for s in held.sequences])
    assert not any(torch.equal(x, y) for x in a for y in b)
    _, none, _ = held_out_objectives(m, None, t, HeldOutText(search=1, check=0, tokens=160, continuation=8))
    assert none is None


def test_text_settings_are_checked():
    with pytest.raises(MoendError, match="search"):
        HeldOutText(search=0)
    with pytest.raises(MoendError, match="check"):
        HeldOutText(check=-1)
    assert isinstance(MeasuredKL, type)
