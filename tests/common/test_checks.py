"""The shared argument checks (moend_fx.common.checks): what passes, and what each error says."""

import pytest

from moend_fx.common.checks import check_bits, check_choice, check_int, check_names, check_power_of_two
from moend_fx.common.errors import BudgetError, MoendError, PlanError
from moend_fx.common.options import Kernel


def test_check_int():
    assert check_int("n", 3) == 3
    assert check_int("n", 0, minimum=0) == 0
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(MoendError, match=r"n=.* is invalid; allowed: a positive integer"):
            check_int("n", bad)
    with pytest.raises(BudgetError, match="allowed: an integer >= 2"):
        check_int("length", 1, minimum=2, error=BudgetError)


def test_check_power_of_two():
    assert [check_power_of_two("g", v) for v in (1, 2, 32, 1024)] == [1, 2, 32, 1024]
    for bad in (0, 3, 48, -4, 32.0, True):
        with pytest.raises(MoendError, match=r"g=.* is invalid; allowed: a power of two"):
            check_power_of_two("g", bad)


def test_check_bits():
    assert [check_bits("k_bits", b) for b in (16, 8, 4)] == [16, 8, 4]
    with pytest.raises(PlanError, match=r"k_bits=3 is not a supported bit width; allowed: \[16, 8, 4\]"):
        check_bits("k_bits", 3, error=PlanError)
    with pytest.raises(MoendError, match="allowed: \\[8, 4\\]"):
        check_bits("v_bits", 16, allowed=(8, 4))
    with pytest.raises(MoendError):
        check_bits("k_bits", True)


def test_check_choice_returns_the_enum_member_for_a_string():
    got = check_choice("kernel", "cpu", Kernel)
    assert got is Kernel.CPU and got == "cpu"
    assert check_choice("task", "passkey", ("passkey", "niah")) == "passkey"
    with pytest.raises(MoendError, match="kernel='gpu' is unknown; allowed: auto, cpu, triton, reference"):
        check_choice("kernel", "gpu", Kernel)
    with pytest.raises(MoendError, match="unknown"):
        check_choice("kernel", 1, Kernel)


def test_check_names():
    assert check_names("methods", "method", ["a", "b"], {"a": 1, "b": 2}) == ("a", "b")
    with pytest.raises(MoendError, match="methods is empty; give at least one"):
        check_names("methods", "method", [], {"a": 1})
    with pytest.raises(MoendError, match="method 'c' is unknown; allowed: a, b"):
        check_names("methods", "method", ["a", "c"], {"a": 1, "b": 2})
    with pytest.raises(MoendError, match="repeat a name"):
        check_names("methods", "method", ["a", "a"], {"a": 1}, unique=True)
    assert check_names("methods", "method", ["a", "a"], {"a": 1}) == ("a", "a")
