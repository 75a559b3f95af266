"""One contract for `tplab.Lab` and `tplab.Simulation` (tplab/lab/contract.py): both
implement the `Ranks` Protocol exactly, and one test of every public method and argument
runs against both (2 ranks in processes, 2 simulated)."""

from __future__ import annotations

import importlib
import sys

import pytest

import tplab
from tplab.lab.contract import Ranks, check, differences
from tplab.lab.launch import Lab
from tplab.lab.simulate import Simulation


def test_both_implement_the_protocol_exactly():
    assert check(Lab) is Lab and check(Simulation) is Simulation


def test_the_check_can_fail():
    class Drifted(Simulation):
        def run(self, fn, *args, timeout=None, **kwargs):  # no ranks, no cell_timeout
            return []

    found = differences(Drifted)
    assert len(found) == 1 and "Drifted.run" in found[0], found
    with pytest.raises(TypeError, match="Drifted.run"):
        check(Drifted)


@pytest.fixture(scope="module", params=["processes", "simulated"])
def ranks(request):
    made = tplab.launch(2) if request.param == "processes" else tplab.simulate(2)
    yield made
    made.shutdown()


def keywords(**kwargs):
    return sorted(kwargs)


def test_run_keeps_its_own_keywords(ranks):
    assert isinstance(ranks, Ranks)
    got = ranks.run(keywords, timeout=30, cell_timeout=30, ranks=[1], depth=3)
    assert got == [["depth"]]  # timeout, cell_timeout and ranks never reach fn
    with pytest.raises(ValueError, match="cell_timeout"):
        ranks.run(keywords, cell_timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        ranks.run(keywords, timeout=0)


def test_execute_push_pull(ranks):
    assert ranks.execute("1 + 1", timeout=30, cell_timeout=30) == [2, 2]
    assert ranks.execute("2 * 3", ranks=[0]) == [6]
    ranks.push({"w": 5})
    assert ranks.pull("w") == [5, 5]
    ranks.push({"only": 7}, ranks=[1])
    assert ranks.pull("only", ranks=[1]) == [7]
    with pytest.raises(tplab.LabError, match="'only' is not defined on rank 0"):
        ranks.pull("only")
    with pytest.raises(ValueError, match="identifiers"):
        ranks.push({"not a name": 1})
    with pytest.raises(TypeError):
        ranks.push([("w", 1)])
    with pytest.raises(TypeError):
        ranks.pull(3)


def test_reload_restart_and_closed(ranks, tmp_path, monkeypatch):
    (tmp_path / "contract_mod.py").write_text("def value():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("contract_mod")
    assert ranks.run(module.value) == [1, 1]
    (tmp_path / "contract_mod.py").write_text("def value():\n    return 22\n")
    module = ranks.reload(module)
    assert ranks.run(module.value) == [22, 22]
    with pytest.raises(TypeError, match="module"):
        ranks.reload("contract_mod")
    sys.modules.pop("contract_mod", None)
    ranks.push({"gone": 1})
    assert isinstance(ranks.restart(), float)
    with pytest.raises(tplab.LabError, match="'gone' is not defined"):
        ranks.pull("gone")
    assert ranks.closed is False
