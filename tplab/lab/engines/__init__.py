"""Engine kinds: how a lab's ranks are started, found, heard, watched and stopped.

One kind is one object in one file of this package: `local` (this machine, forked from a
fork server), `mpi` (mpiexec), `ssh`, `slurm`, `batch` (any other batch system), and the
generic `EngineKind` (kind.py) for every other ipyparallel engine launcher. A module here
that defines `KIND` (an EngineKind subclass) is a kind, found by its file name:
`tplab.launch(engines="flux")` takes `KIND` from `engines/flux.py`; a launcher class finds
the kind whose `KIND.launcher_base` it subclasses. `kind_for` is the one resolver of
`engines=`. See docs/DESIGN.md ("Engine kinds") and docs/CLUSTER.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from importlib.metadata import entry_points

from ipyparallel.cluster.launcher import find_launcher_class

from tplab.errors import LabError
from tplab.lab.engines.kind import EngineKind
from tplab.lab.engines.watch import EngineWatch, hint_for, start_error

__all__ = ["EngineKind", "EngineWatch", "hint_for", "kind_for", "kind_names", "kinds",
           "start_error"]


def _kind_of(module_name: str) -> type[EngineKind] | None:
    """The KIND of module `module_name` of this package, or None when it defines none."""
    kind = getattr(importlib.import_module(f"{__name__}.{module_name}"), "KIND", None)
    return kind if isinstance(kind, type) and issubclass(kind, EngineKind) else None


def kind_names() -> list[str]:
    """The file name of every kind module (what `engines=` takes), sorted."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__)
                  if _kind_of(info.name) is not None)


def kinds() -> list[type[EngineKind]]:
    """Every kind module's KIND, the most specific launcher first."""
    found = [_kind_of(name) for name in kind_names()]
    return sorted(found, key=lambda k: -len(k.launcher_base.__mro__) if k.launcher_base else 0)


def _module_for(name: str) -> str | None:
    """The kind module named `name` (its file name), or None."""
    if not name.isidentifier() or importlib.util.find_spec(f"{__name__}.{name}") is None:
        return None
    return name if _kind_of(name) is not None else None


def _unknown(engines) -> LabError:
    launchers = sorted(e.name for e in entry_points(group="ipyparallel.engine_launchers"))
    return LabError(f"unknown engines {engines!r}: use one of tplab's engine kinds "
                    f"({', '.join(map(repr, kind_names()))}, tplab/lab/engines/) or of "
                    f"ipyparallel's engine launchers: {', '.join(launchers)}")


def kind_for(engines, fork: bool = False) -> EngineKind:
    """The kind for `engines=`: an EngineKind object (used as it is); a kind's file name in
    this package ("local", "mpi", "ssh", "slurm", "batch", or one added); another
    ipyparallel engine launcher's name or a launcher class (the kind whose launcher_base
    it subclasses, else the generic one). Anything else is a LabError naming the valid."""
    if isinstance(engines, EngineKind):
        return engines
    if isinstance(engines, str):
        module = _module_for(engines.lower())
        if module is not None:
            return _kind_of(module)(fork=fork)
        try:
            launcher = find_launcher_class(engines, "engine")
        except Exception:  # noqa: BLE001 - any failure to resolve: name the valid ones
            raise _unknown(engines) from None
    elif isinstance(engines, type):
        launcher = engines
    else:
        raise LabError(f"engines must be an engine kind's name such as 'local' or 'mpi', an "
                       f"EngineKind or a launcher class, got {engines!r}")
    for cls in kinds():
        if cls.launcher_base is not None and issubclass(launcher, cls.launcher_base):
            return cls(engines, fork=fork)
    return EngineKind(engines)
