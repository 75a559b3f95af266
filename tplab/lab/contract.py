"""The one contract of `tplab.Lab` (rank processes) and `tplab.Simulation` (ranks in this
process): `Ranks`, a Protocol both implement, method for method, keyword for keyword and
attribute for attribute, so that a notebook, and every part of tplab outside tplab/lab/,
runs unchanged on either (docs/DESIGN.md, "One contract"). Code outside tplab/lab/ takes
`lab: Ranks` and asks it what it needs (`in_process`, `shared_dir`, `time_limit(s)`...),
never which class it is (tests/test_contract.py checks that no module there does).

`check(cls)` compares a class's public methods with the Protocol's (the same parameters,
kinds and defaults) and looks for each of its attributes (a property, a class attribute
or an annotation). tests/test_contract.py checks both classes with it and runs every
method and argument against both.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Protocol, runtime_checkable


@runtime_checkable
class Ranks(Protocol):
    """`world_size` ranks that run code SPMD; every method returns one item per rank."""

    world_size: int
    in_process: bool  # True: the ranks run in this process (tplab.simulate), no processes
    backend: str  # the process group's backend: "gloo", "nccl" ("auto": the ranks decide),
    # or "simulated" (in process)
    threads_per_rank: int | None  # torch threads each rank uses (None: this process's own)
    shared_dir: str | None  # a folder the ranks read as this process does (None: none)
    rank_pids: list[int]  # each rank process's pid on its own host ([] in process)

    @property
    def closed(self) -> bool:
        """True once shut down."""

    def run(self, fn, *args, timeout: float | None = None, ranks=None,
            cell_timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank (or `ranks`); tplab's keywords are never fn's."""

    def execute(self, code: str, timeout: float | None = None, ranks=None,
                cell_timeout: float | None = None) -> list:
        """A cell's code on every rank (%%ranks); the last expression's value per rank."""

    def push(self, mapping: dict, ranks=None) -> None:
        """Set names (identifiers) on every rank (or `ranks`)."""

    def pull(self, name: str, ranks=None) -> list:
        """The value of `name` on every rank (or `ranks`); a LabError names those without."""

    def reload(self, module: types.ModuleType) -> types.ModuleType:
        """An edited module loaded anew where the ranks run."""

    def restart(self) -> float:
        """Fresh ranks (names defined on them are gone); returns seconds."""

    def shutdown(self) -> None:
        """End everything; idempotent."""

    def time_limit(self, seconds: float) -> contextlib.AbstractContextManager[TimeLimit]:
        """A wall-clock limit on the ranks' computing inside the block: rank processes are
        interrupted (a CellTimeout), code in this process is stopped between the learner's
        bytecodes (a TimeLimitReached). Yields a `TimeLimit`."""


class TimeLimit(Protocol):
    """What `Ranks.time_limit` yields: `reached` is True once the limit stopped code (even
    when that code caught what it raised)."""

    seconds: float
    reached: bool


METHODS = ("run", "execute", "push", "pull", "reload", "restart", "shutdown", "time_limit")
ATTRIBUTES = ("world_size", "in_process", "backend", "threads_per_rank", "shared_dir",
              "rank_pids")


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _declares(cls, name: str) -> bool:
    """`cls` has `name` as a class attribute or property, or annotates it (set per object)."""
    return any(name in vars(klass) or name in vars(klass).get("__annotations__", {})
               for klass in cls.__mro__)


def differences(cls) -> list[str]:
    """How `cls` departs from `Ranks`: each method whose parameters differ, each missing
    method or attribute."""
    found = []
    for name in METHODS:
        theirs = getattr(cls, name, None)
        if theirs is None:
            found.append(f"{cls.__name__}.{name} is missing")
        elif _shape(theirs) != _shape(getattr(Ranks, name)):
            found.append(f"{cls.__name__}.{name}{inspect.signature(theirs)} differs from "
                         f"Ranks.{name}{inspect.signature(getattr(Ranks, name))}")
    if not isinstance(getattr(cls, "closed", None), property):
        found.append(f"{cls.__name__}.closed is not a property")
    found += [f"{cls.__name__}.{name} is missing (an attribute of Ranks)"
              for name in ATTRIBUTES if not _declares(cls, name)]
    return found


def check(cls) -> type:
    """Raise TypeError when `cls` does not implement `Ranks` exactly; returns cls."""
    found = differences(cls)
    if found:
        raise TypeError("; ".join(found))
    return cls
