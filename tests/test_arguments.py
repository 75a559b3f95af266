"""A property-based test of the argument space of launch, simulate, run and the magics:
every input either works or raises a LabError, TypeError or ValueError whose message names
the argument; never a traceback from inside tplab or ipyparallel."""

from __future__ import annotations

import traceback

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tplab
from tplab.lab.arguments import parse_rank_spec

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.floats(allow_nan=True),
                     st.text(max_size=6), st.lists(st.integers(-2, 6), max_size=4),
                     st.tuples(st.integers(0, 3)), st.dictionaries(st.text(max_size=3),
                                                                    st.integers(), max_size=2))
CLEAR = (tplab.LabError, TypeError, ValueError)


def clear_error(exc: BaseException, *names: str) -> None:
    assert isinstance(exc, CLEAR), f"{type(exc).__name__}: {exc}"
    assert any(n in str(exc) for n in names), f"{names} not named in: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    # raised by tplab's checks, not by code deeper down (ipyparallel, torch, psutil...)
    assert "arguments.py" in frames[-1].filename or "magics.py" in frames[-1].filename \
        or "launch.py" in frames[-1].filename or "cells.py" in frames[-1].filename \
        or "simulate.py" in frames[-1].filename, frames[-1]


@settings(max_examples=60, deadline=None)
@given(world_size=ANYTHING, backend=ANYTHING, timeout=ANYTHING, threads=ANYTHING)
def test_launch_arguments(world_size, backend, timeout, threads):
    # a valid world size with a valid rest would start a lab: keep one argument bad
    if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1:
        backend = backend if backend not in ("auto", "gloo", "nccl") else "bogus"
    try:
        tplab.launch(world_size, backend=backend, timeout=timeout, threads_per_rank=threads)
    except BaseException as exc:  # noqa: BLE001 - what is raised is what is checked
        clear_error(exc, "world_size", "backend", "timeout", "threads_per_rank")
    else:
        raise AssertionError("a bad launch was accepted")


@settings(max_examples=40, deadline=None)
@given(name=st.text(min_size=1, max_size=12).filter(str.isidentifier), value=ANYTHING)
def test_unknown_launch_keywords(name, value):
    if name in ("world_size", "backend", "engines", "timeout", "cell_timeout", "ip",
                "threads_per_rank", "fork", "master_addr", "cluster_options"):
        return
    import ipyparallel as ipp

    if name in ipp.Cluster.class_trait_names():
        return
    with pytest.raises(TypeError) as info:
        tplab.launch(2, **{name: value})
    assert f"unknown keyword {name!r}" in str(info.value)


@settings(max_examples=40, deadline=None)
@given(world_size=ANYTHING)
def test_simulate_world_size(world_size):
    try:
        sim = tplab.simulate(world_size)
    except BaseException as exc:  # noqa: BLE001
        clear_error(exc, "world_size")
    else:
        assert sim.world_size == world_size


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks=ANYTHING, timeout=ANYTHING, cell_timeout=ANYTHING)
def test_run_arguments(labs, ranks, timeout, cell_timeout):
    lab = labs.get(2)
    try:
        got = lab.run(lambda: 1, ranks=ranks, timeout=timeout, cell_timeout=cell_timeout)
    except BaseException as exc:  # noqa: BLE001
        clear_error(exc, "ranks", "timeout", "cell_timeout")
    else:
        assert got == [1] * len(got) and len(got) >= 1


@settings(max_examples=200, deadline=None)
@given(line=st.text(alphabet="0123456789-, \t9a", max_size=10), world_size=st.integers(1, 8))
def test_rank_magic_forms(line, world_size):
    try:
        ranks = parse_rank_spec(line, world_size)
    except ValueError as exc:
        assert "%%rank" in str(exc)
    else:
        assert ranks and all(0 <= r < world_size for r in ranks)
        assert len(set(ranks)) == len(ranks)
