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
from tplab.lab.engines import kind_for, kind_names
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
