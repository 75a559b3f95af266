"""Bad input gets a clear error naming the argument and what is valid, before anything starts."""

from __future__ import annotations

import psutil
import pytest

import tplab


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"world_size": 0}, tplab.LabError, "world_size must be at least 1, got 0"),
    ({"world_size": -2}, tplab.LabError, "world_size must be at least 1"),
    ({"world_size": 4096}, tplab.LabError, "world_size=4096 is more than this machine can run"),
    ({"world_size": "4"}, TypeError, "world_size must be an int"),
    ({"world_size": 2.0}, TypeError, "world_size must be an int"),
    ({"world_size": 2, "backend": "mpi"}, tplab.LabError,
     "unknown backend 'mpi': use one of 'auto', 'gloo', 'nccl'"),
    ({"world_size": 2, "engines": "bogus"}, tplab.LabError, "unknown engines 'bogus'"),
    ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a positive number"),
    ({"world_size": 2, "timeout": -1}, ValueError, "timeout must be a positive number"),
    ({"world_size": 2, "timeout": "10"}, ValueError, "timeout must be a positive number"),
    ({"world_size": 2, "ip": ""}, tplab.LabError, "ip must be an address"),
])
def test_launch_refuses_bad_arguments_before_starting_anything(kwargs, error, words):
    before = children()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        tplab.launch(**kwargs)
    assert children() == before


def test_unknown_engines_lists_the_valid_launchers():
    with pytest.raises(tplab.LabError) as info:
        tplab.launch(2, engines="bogus")
    assert "'local'" in str(info.value) and "mpi" in str(info.value)


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 2, reason="machine has GPUs")
def test_nccl_without_enough_gpus():
    before = children()
    with pytest.raises(tplab.LabError, match="backend='nccl' needs one GPU per rank"):
        tplab.launch(2, backend="nccl")
    assert children() == before


def test_bad_call_arguments_are_refused(labs):
    lab = labs.get(2)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        lab.run(lambda: 1, timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        lab.execute("1", timeout=-5)
    with pytest.raises(TypeError, match="needs a function"):
        lab.run("not a function")
    with pytest.raises(TypeError, match="needs code as a string"):
        lab.execute(lambda: 1)
    with pytest.raises(ValueError, match="ranks must be rank numbers from 0 to 1, got \\[5\\]"):
        lab.execute("1", ranks=[5])
    with pytest.raises(TypeError, match="needs a dict"):
        lab.push(["x"])
    assert lab.run(lambda: 2) == [2, 2]  # nothing was changed


@pytest.mark.parametrize(("line", "ranks"), [
    ("0", [0]), ("0,2", [0, 2]), ("0 2", [0, 2]), ("1 0", [1, 0]), ("0, 2-3", [0, 2, 3]),
    (" 1-3 ", [1, 2, 3]),
])
def test_rank_spec_forms(line, ranks):
    from tplab.lab.validate import parse_rank_spec

    assert parse_rank_spec(line, 4) == ranks


@pytest.mark.parametrize(("line", "words"), [
    ("zero", "%%rank takes rank numbers, got 'zero': use %%rank 0,2 or %%rank 0 2 or %%rank 1-3"),
    ("9", "this lab has ranks 0 to 3 (no rank 9)"),
    ("3-1", "range '3-1' runs backwards: write 1-3"),
    ("", "%%rank needs the ranks to run on"),
    ("-1", "%%rank takes rank numbers"),
])
def test_magic_with_bad_ranks_names_the_problem(line, words):
    from tplab.lab.validate import parse_rank_spec

    with pytest.raises(ValueError) as info:
        parse_rank_spec(line, 4)
    assert words in str(info.value)


def test_each_kind_checks_the_size_it_can_run():
    from tplab.lab.engines import kind_for

    # local ranks: this machine's memory and GPUs decide, before anything starts
    with pytest.raises(tplab.LabError, match="world_size=4096 is more than this machine"):
        kind_for("local").check_size(4096, "gloo")
    kind_for("local").check_size(1, "gloo")
    # ranks on other hosts: this machine's memory says nothing about them
    kind_for("mpi").check_size(4096, "nccl")
