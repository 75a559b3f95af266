"""Issue 38 items 12 and 18 (the Explorer's part): a setting the panel cannot take says
what is wrong with it, in words that hold."""

from __future__ import annotations

import math

import pytest

import tplab
from tplab.checks.explorer import Explorer


@pytest.fixture(scope="module")
def explorer():
    return Explorer(tplab.simulate(2), model="mlp")


def test_tp_as_a_string_is_a_type_error_not_one_of_2_not_2(explorer):
    with pytest.raises(TypeError) as e:
        explorer.set(tp="2")
    assert str(e.value) == "tp must be an int, one of [2]; got str '2'"


def test_tp_1_is_refused_for_what_it_is_not_for_not_dividing(explorer):
    with pytest.raises(ValueError) as e:
        explorer.set(tp=1)
    message = str(e.value)
    assert "must divide" not in message   # 1 divides 2: that would be false
    assert message.startswith("tp = 1 splits nothing") and "one of [2]" in message
    assert explorer.settings.tp == 2 and explorer.report.ok


@pytest.mark.parametrize("name", ["atol", "rtol"])
@pytest.mark.parametrize("value", [-1, math.nan, math.inf])
def test_a_tolerance_grad_check_cannot_use_names_itself(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
        Explorer(tplab.simulate(2), **{name: value})


def test_a_tolerance_as_text_names_itself():
    with pytest.raises(TypeError, match="atol must be a number such as 1e-5, not str '1e-5'"):
        Explorer(tplab.simulate(2), atol="1e-5")
