"""examples/plan_ablation.py: the plan variants it compresses with (on a synthetic table; no model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moend_fx.calibration.tables import load_table
from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import plan_bytes
from moend_fx.solvers import get_solver

SCRIPT = Path(__file__).parents[2] / "examples" / "plan_ablation.py"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("plan_ablation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def solved():
    table = load_table("synthetic:30:0")
    return table, get_solver("greedy").solve(table, "14x", context_length=2048).plan


def test_bit_and_keep_variants_change_only_what_they_name(ablation, solved):
    table, plan = solved
    assert ablation.variant_plan(plan, "base", table, "14x") is plan
    k8v4 = ablation.variant_plan(plan, "k8v4", table, "14x")
    assert [c.keep_ratio for c in k8v4.layers] == [c.keep_ratio for c in plan.layers]
    assert {(c.k_bits, c.v_bits) for c in k8v4.layers} == {(8, 4)}
    keep1 = ablation.variant_plan(plan, "keep1", table, "14x")
    assert {c.keep_ratio for c in keep1.layers} == {1.0}
    assert [(c.k_bits, c.v_bits) for c in keep1.layers] == [(c.k_bits, c.v_bits) for c in plan.layers]


def test_no_k4_is_the_greedy_plan_without_4_bit_keys_within_the_same_budget(ablation, solved):
    table, plan = solved
    assert any(c.k_bits == 4 for c in plan.layers)  # else the variant would test nothing
    barred = ablation.variant_plan(plan, "no-k4", table, "14x")
    assert all(c.k_bits != 4 for c in barred.layers)
    assert barred.budget_bytes == plan.budget_bytes and plan_bytes(barred) <= barred.budget_bytes


def test_scorer_variants_parse_their_option(ablation):
    assert ablation.scorer_kwargs("kernel=17") == {"kernel_size": 17}
    assert ablation.scorer_kwargs("trig-weight=0.5") == {"trig_weight": 0.5}
    assert ablation.scorer_kwargs("k8v8") == {}


@pytest.mark.parametrize("bad", ["k8x4", "k3v4", "k8v4v2", "kernel=4", "kernel=x", "trig-weight=-1", "foo", ""])
def test_an_unknown_variant_is_a_clear_error_naming_the_allowed_ones(ablation, bad):
    with pytest.raises(MoendError, match="allowed: base, keep1, no-k4"):
        ablation.check_variant(bad)


@pytest.mark.parametrize("good", ["base", "keep1", "no-k4", "k8v4", "k16v16", "kernel=17", "trig-weight=0.5"])
def test_known_variants_pass(ablation, good):
    assert ablation.check_variant(good) == good
