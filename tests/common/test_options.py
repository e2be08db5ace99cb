"""Closed option sets (moend_fx.common.options) behave as strings wherever users pass strings."""

import json

import pytest

from moend_fx.common import options
from moend_fx.common.options import Kernel, ScorerName, option_set

SETS = [options.ScorerName, options.BudgetMode, options.QuantMode, options.Pooling, options.Kernel,
        options.InnerCompiler, options.Setting]


@pytest.mark.parametrize("enum", SETS, ids=lambda e: e.__name__)
def test_members_are_their_strings(enum):
    for member in enum:
        assert member == member.value and str(member) == member.value and f"{member}" == member.value
        assert enum(member.value) is member
        assert json.loads(json.dumps(member)) == member.value
    assert enum.__doc__ and enum.__module__ == "moend_fx.common.options"


def test_option_set_keeps_declaration_order_and_rejects_unknown_values():
    colours = option_set("Colours", "Test colours.", "red", "green")
    assert [str(c) for c in colours] == ["red", "green"] and colours.RED == "red"
    with pytest.raises(ValueError):
        colours("blue")


def test_registries_and_enums_agree():
    from moend_fx.eviction.scorers import SCORERS

    assert set(SCORERS) == set(ScorerName)
    assert Kernel.AUTO in ("auto", "cpu")
