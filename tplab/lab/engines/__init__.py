"""Engine kinds: how a lab's ranks are started, found, heard, watched and stopped.

One kind is one object in one file of this package: `local` (this machine, forked from a
fork server), `mpi` (mpiexec), `ssh`, `slurm`, `batch` (any other batch system), and the
generic `EngineKind` (kind.py) for every other ipyparallel engine launcher. A module here
that defines `KIND` (an EngineKind subclass) is a kind: `tplab.launch(engines=KIND.name)`
finds it, and so does a launcher class that subclasses `KIND.launcher_base`.
See docs/DESIGN.md ("Engine kinds") and docs/CLUSTER.md.
"""

from __future__ import annotations

import importlib
import pkgutil

from ipyparallel.cluster.launcher import find_launcher_class

from tplab.errors import LabError
from tplab.lab.engines.kind import EngineKind
from tplab.lab.engines.watch import EngineWatch, hint_for, start_error

__all__ = ["EngineKind", "EngineWatch", "hint_for", "kind_for", "kinds", "start_error"]


def kinds() -> list[type[EngineKind]]:
    """Every kind module's KIND, the most specific launcher first."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        kind = getattr(module, "KIND", None)
        if isinstance(kind, type) and issubclass(kind, EngineKind):
            found.append(kind)
    return sorted(found, key=lambda k: -len(k.launcher_base.__mro__) if k.launcher_base else 0)


def kind_for(engines, fork: bool = False) -> EngineKind:
    """The kind for `engines=`: a kind's name ("local", "mpi", "ssh", "slurm"), an
    EngineKind object, another ipyparallel engine launcher's name, or a launcher class."""
    if isinstance(engines, EngineKind):
        return engines
    known = kinds()
    if isinstance(engines, str):
        for cls in known:
            if cls.name == engines.lower():
                return cls(fork=fork)
        try:
            launcher = find_launcher_class(engines, "engine")
        except Exception:  # noqa: BLE001 - any failure to resolve: name the valid ones
            raise LabError(f"unknown engines {engines!r}") from None
    else:
        launcher = engines
    for cls in known:
        if cls.launcher_base is not None and issubclass(launcher, cls.launcher_base):
            return cls(engines, fork=fork)
    return EngineKind(engines)
