"""The one contract of `tplab.Lab` (rank processes) and `tplab.Simulation` (ranks in this
process): `Ranks`, a Protocol both implement, method for method and keyword for keyword,
so that a notebook runs unchanged on either (docs/DESIGN.md, "One contract").

`check(cls)` compares a class's public methods with the Protocol's: the same parameters,
kinds and defaults. tests/test_contract.py checks both classes with it and runs every
method and argument against both.
"""

from __future__ import annotations

import inspect
import types
from typing import Protocol, runtime_checkable


@runtime_checkable
class Ranks(Protocol):
    """`world_size` ranks that run code SPMD; every method returns one item per rank."""

    world_size: int

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


METHODS = ("run", "execute", "push", "pull", "reload", "restart", "shutdown")


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def differences(cls) -> list[str]:
    """How `cls` departs from `Ranks`: each method whose parameters differ, each missing."""
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
    return found


def check(cls) -> type:
    """Raise TypeError when `cls` does not implement `Ranks` exactly; returns cls."""
    found = differences(cls)
    if found:
        raise TypeError("; ".join(found))
    return cls
