"""One contract for `tplab.Lab` and `tplab.Simulation` (tplab/lab/contract.py): both
implement the `Ranks` Protocol exactly, and one test of every public method and argument
runs against both (2 ranks in processes, 2 simulated)."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys
import time

import psutil
import pytest

import tplab
from tplab.lab.contract import ATTRIBUTES, METHODS, Ranks, check, differences
from tplab.lab.launch import Lab
from tplab.lab.simulate import Simulation
from tplab.lab.time_limit import TimeLimitReached


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


def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "finished"


def test_the_attributes_callers_use(ranks):
    assert ranks.in_process is (ranks.backend == "simulated")
    if ranks.in_process:
        assert (ranks.threads_per_rank, ranks.shared_dir, ranks.rank_pids) == (None, None, [])
    else:  # local ranks: the lab's folder is theirs too, and their pids are this machine's
        assert ranks.threads_per_rank >= 1 and os.path.isdir(ranks.shared_dir)
        assert all(psutil.pid_exists(p) for p in ranks.rank_pids) and len(ranks.rank_pids) == 2


def test_time_limit_stops_computing_and_the_ranks_stay_usable(ranks):
    with ranks.time_limit(30) as limit:
        assert ranks.run(spin, 0) == ["finished"] * 2
    assert limit.reached is False and limit.seconds == 30
    stopped = tplab.CellTimeout if not ranks.in_process else TimeLimitReached
    with pytest.raises(stopped), ranks.time_limit(0.5) as limit:
        ranks.run(spin, 600)
    assert limit.reached is True
    assert ranks.run(spin, 0) == ["finished"] * 2
    with pytest.raises(ValueError, match="time_limit"), ranks.time_limit(0):
        pass

# --- code outside tplab/lab/ uses only the contract --------------------------------------

ROOT = pathlib.Path(tplab.__file__).parent
CLASSES = {"Lab", "Simulation"}
# what only one of the classes has, or what Ranks has (asked for, not probed)
PROBED = {"cell_timeout", "engines", "state_dir", "processes", "kind", "watchdog", "fork",
          *ATTRIBUTES, *METHODS, "closed"}
BACKEND_WORDS = {"simulated", "fake"}


def probes(source: str) -> list[str]:
    """Where `source` tells a Lab from a Simulation other than through `Ranks`: isinstance
    on either class, a backend compared with "simulated"/"fake", getattr/hasattr on a lab's
    member, or a member of one class only read from `lab`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id == "isinstance" and len(args) == 2:
                names = {n.id for n in ast.walk(args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(args[1]) if isinstance(n, ast.Attribute)}
                if names & CLASSES:
                    found.append(f"{where}: isinstance(..., {sorted(names & CLASSES)[0]})")
            elif node.func.id in ("getattr", "hasattr") and len(args) >= 2 \
                    and isinstance(args[1], ast.Constant) and args[1].value in PROBED:
                found.append(f"{where}: {node.func.id}(..., {args[1].value!r})")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            words = {s.value for s in sides if isinstance(s, ast.Constant)}
            if words & BACKEND_WORDS and any(
                    isinstance(s, ast.Attribute) and s.attr == "backend" for s in sides):
                found.append(f"{where}: backend compared with {sorted(words)[0]!r}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("lab", "sim", "ranks") and node.attr in (
                    PROBED - set(ATTRIBUTES) - set(METHODS) - {"closed"}):
            found.append(f"{where}: {node.value.id}.{node.attr} (not in Ranks)")
    return found


def test_the_probe_finder_finds_probes():
    source = ("def f(lab, x):\n"
              "    a = isinstance(lab, Simulation) or x.backend == 'simulated'\n"
              "    b = hasattr(lab, 'cell_timeout') and getattr(lab, 'threads_per_rank', 1)\n"
              "    return lab.engines == 'local', lab.in_process, lab.shared_dir\n")
    assert [p.split(":")[0] for p in probes(source)] == [
        "line 2", "line 2", "line 3", "line 3", "line 4"], probes(source)
    assert probes("def f(lab: Ranks):\n    return lab.in_process and lab.run(f)\n") == []


def test_no_module_outside_lab_tells_the_classes_apart():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(ROOT / "lab"):
            continue
        hits = probes(path.read_text())
        if hits:
            found[str(path.relative_to(ROOT.parent))] = hits
    assert not found, f"use tplab.lab.contract.Ranks' members instead: {found}"
