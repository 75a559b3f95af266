"""Issue 38 items 8 and 20: CostExplorer.update from code never clamps or coerces a value
the control could not hold; it names the control and what it takes."""

import pytest

from tplab.cost.explorer import CostExplorer


@pytest.fixture(scope="module")
def explorer():
    return CostExplorer()


@pytest.mark.parametrize("values, error, says", [
    (dict(batch=128), ValueError, r"batch must be from 1 to 64.*got 128"),
    (dict(batch=0), ValueError, r"batch must be from 1 to 64.*got 0"),
    (dict(batch=-3), ValueError, r"batch must be from 1 to 64.*got -3"),
    (dict(batch=2.5), TypeError, "batch must be an int"),
    (dict(hidden="4096"), TypeError, "hidden must be an int.*'4096'"),
    (dict(hidden=0), ValueError, "hidden must be at least 1"),
    (dict(seq=True), TypeError, "seq must be an int"),
    (dict(sequence_parallel="yes"), TypeError, "sequence_parallel must be True or False"),
    (dict(recompute="ful"), ValueError, r"recompute must be one of \['none', 'selective'"),
    (dict(layout="paper"), ValueError, r"layout must be one of \['tplab', 'gpt'\]"),
    (dict(sharding="fdsp"), ValueError, "sharding must be one of"),
])
def test_a_value_the_control_cannot_hold_is_an_error_naming_it(explorer, values, error, says):
    before = {name: c.value for name, c in explorer.controls.items()}
    with pytest.raises(error, match=says):
        explorer.update(**values)
    assert {name: c.value for name, c in explorer.controls.items()} == before


def test_values_in_range_are_priced_as_given(explorer):
    explorer.update(batch=64, hidden=3072, layout="gpt", recompute="full")
    assert explorer.shape.batch == 64 and explorer.shape.hidden == 3072
    assert explorer.controls["layout"].value == "gpt"
