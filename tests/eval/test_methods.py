"""moend_fx/eval/methods.py: how the uniform baselines' plans are chosen (no model)."""

import dataclasses

from moend_fx.calibration.tables import load_table
from moend_fx.common.errors import BudgetError
from moend_fx.eval.plan_book import PlanBook
from moend_fx.plan.routing import LayerConfig
from moend_fx.solvers import get_solver


def _cheap_k4_table():
    """The synthetic table with every 4-bit key as cheap in S as the 8-bit one (fewer bytes, same loss), so that
    without the last-resort rule the best pyramid keeps its low keep ratios at K4."""
    t = load_table("synthetic:30:0")
    S = t.S.copy()
    for j, c in enumerate(t.grid.configs):
        if c.k_bits == 4:
            S[:, j] = t.column(LayerConfig(c.keep_ratio, 8, c.v_bits))
    return dataclasses.replace(t, S=S)


def test_the_pyramid_baseline_prefers_a_bit_pair_without_last_resort_layers():
    t = _cheap_k4_table()
    entry = PlanBook(t).get("pyramid", "14x", 2048)
    assert [c for c in entry.plan.layers if c.k_bits <= 4 and c.keep_ratio < 0.5] == []
    fits = []
    for kb in t.grid.k_bits:
        for vb in t.grid.v_bits:
            try:
                fits.append(get_solver("pyramid", k_bits=kb, v_bits=vb, narrow_k_min_keep=0).solve(
                    t, "14x", context_length=2048))
            except BudgetError:  # most pairs need more than 1/14 of the cache
                continue
    # without the rule a 4-bit-key pyramid predicts less loss: the order, not the loss alone, chose the pair
    plain = min(fits, key=lambda r: r.predicted_loss)
    assert plain.plan.layers[-1].k_bits == 4 and plain.predicted_loss < entry.predicted_loss


def test_2d_hetero_anyk_is_the_greedy_plan_without_the_last_resort_rule():
    t = _cheap_k4_table()
    book = PlanBook(t)
    anyk, default = book.get("2d_hetero_anyk", "14x", 2048), book.get("2d_hetero", "14x", 2048)
    plain = get_solver("greedy", narrow_k_min_keep=0).solve(t, "14x", context_length=2048)
    assert anyk.plan.layers == plain.plan.layers
    narrow = [c for c in anyk.plan.layers if c.k_bits <= 4 and c.keep_ratio < 0.5]
    assert narrow and anyk.plan.layers != default.plan.layers
    assert not [c for c in default.plan.layers if c.k_bits <= 4 and c.keep_ratio < 0.5]
