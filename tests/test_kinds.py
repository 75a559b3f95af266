"""One resolver of `engines=` (tplab/lab/engines/__init__.py, kind_for): a kind object, a
kind file added to tplab/lab/engines/ (found by its file name) and ipyparallel's launcher
names all work with no other edit, and what is none of those is refused naming the valid.
The kinds here are written by the tests."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

import tplab
from tplab.lab import engines
from tplab.lab.engines import EngineKind, kind_for, kind_names
from tplab.lab.engines.batch import BatchKind
from tplab.lab.engines.local import LocalKind
from tplab.lab.engines.mpi import MPIKind

FLUX = '''
from tplab.lab.engines.local import LocalKind


class FluxKind(LocalKind):
    """A kind written by tests/test_kinds.py: local ranks that count their starts."""

    name = "flux"
    starts = 0

    def start_options(self, first_id, env):
        type(self).starts += 1
        return super().start_options(first_id, env)


KIND = FluxKind
'''


@pytest.fixture
def flux(tmp_path, monkeypatch):
    """A new kind file, engines/flux.py, on the engines package's path."""
    (tmp_path / "flux.py").write_text(FLUX)
    monkeypatch.setattr(engines, "__path__", [*engines.__path__, str(tmp_path)])
    yield "flux"
    sys.modules.pop("tplab.lab.engines.flux", None)


def test_every_kind_file_is_named_as_its_kind():
    names = kind_names()
    assert {"local", "mpi", "ssh", "slurm", "batch"} <= set(names)
    assert all(type(kind_for(n)).name == n for n in names), names


def test_a_kind_object_is_used_as_it_is():
    kind = MPIKind()
    assert kind_for(kind) is kind
    with pytest.raises(tplab.LabError, match="more than this machine can run"):
        tplab.launch(4096, engines=LocalKind(fork=True))  # past every check, to the kind's


def test_ipyparallel_names_and_classes_find_their_kind():
    from ipyparallel.cluster.launcher import PBSEngineSetLauncher

    assert type(kind_for("pbs")) is BatchKind and type(kind_for(PBSEngineSetLauncher)) is BatchKind
    assert type(kind_for("MPI")) is MPIKind


def test_anything_else_is_refused_naming_the_valid(flux):
    with pytest.raises(tplab.LabError, match="unknown engines 'fluxx'") as info:
        kind_for("fluxx")
    assert "'flux'" in str(info.value) and "'local'" in str(info.value)
    for bad in ("kind", "watch"):  # modules of the package that are no kind
        with pytest.raises(tplab.LabError, match=f"unknown engines '{bad}'"):
            kind_for(bad)
    with pytest.raises(tplab.LabError, match="engines must be"):
        kind_for(3)


def test_a_new_kind_file_is_found_by_its_name(flux):
    assert type(kind_for(flux)).__name__ == "FluxKind" and "flux" in kind_names()


@pytest.mark.slow
def test_a_new_kind_file_runs_ranks_with_no_other_edit(flux):
    with tplab.launch(2, engines=flux) as lab:
        assert type(lab.kind).__name__ == "FluxKind" and type(lab.kind).starts == 1
        assert lab.run(dist.get_rank) == [0, 1]
        lab.restart()
        assert type(lab.kind).starts == 2 and lab.run(dist.get_rank) == [0, 1]


def spin_forever():
    while True:
        pass


def exit_on_rank_1():
    import os

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.slow
def test_ranks_of_a_generic_launcher_are_reached_through_the_remote_transport(capsys):
    # ipyparallel's own local launcher has no kind of tplab's: the generic kind, whose
    # ranks might be anywhere (output forwarded, signals through ipyparallel, no pid
    # killed here), here on this machine, so that the remote transport runs without hosts
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher

    from tplab.lab.transports import RemoteTransport

    with tplab.launch(2, engines=LocalEngineSetLauncher) as lab:
        assert type(lab.kind) is EngineKind and isinstance(lab.processes.transport,
                                                           RemoteTransport)
        assert lab.shared_dir is None and lab.processes.transport.killable(lab.rank_pids) == []
        lab.run(print, "forwarded", flush=True)
        assert "forwarded" in capsys.readouterr().out
        with pytest.raises(tplab.CellTimeout):  # interrupted through ipyparallel
            lab.run(spin_forever, cell_timeout=2)
        assert lab.run(dist.get_rank) == [0, 1]
        with pytest.raises(tplab.RankDied, match="rank 1"):  # its forwarded stream closed
            lab.run(exit_on_rank_1, timeout=30)


def test_lab_processes_is_the_kinds_only_caller():
    # every other module of the lab reaches the kind through LabProcesses (cluster.py)
    import ast
    import pathlib

    lab_dir = pathlib.Path(tplab.__file__).parent / "lab"
    callers = {}
    for path in lab_dir.glob("*.py"):
        if path.name == "cluster.py":
            continue
        calls = [n.lineno for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                 and n.value.attr == "kind"]
        if calls:
            callers[path.name] = calls
    assert not callers, f"calls on the engine kind outside cluster.py: {callers}"
