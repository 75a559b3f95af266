"""Sending a notebook function to the ranks so that names resolve on the ranks first.

cloudpickle sends a function defined in the notebook (`__main__`) by value, with every
global it uses copied from the notebook. Left alone, the notebook's `rank` (a loop
variable), `world_size` (a parameters cell) or a pushed 256 MB `w` would travel with every
call and silently win over the rank's own. Here:
- the function's globals become the rank's namespace (tplab/rank/runner.py loads them into
  it), so a `global` assignment stays on the rank, as in a %%ranks cell;
- names the ranks are known to define are left out of the pickle (they are not sent
  at all); plain numbers and strings among them travel on the side, so the rank can say
  when the notebook's value differs from its own (a warning, once per name);
- every other name the function uses travels from the notebook, as before.
"""

from __future__ import annotations

import io
import linecache
import sys
import sysconfig
import warnings

import cloudpickle

from tplab.rank import runner as rank_side
from tplab.rank.runner import NAMESPACE_PID

_SCALARS = (bool, int, float, str, type(None))
_STDLIB = sysconfig.get_paths()["stdlib"]
GIVEN_NAMES = ("rank", "world_size", "torch", "dist", "tplab")  # every rank has these


class NameShadowedWarning(UserWarning):
    """A notebook name a function uses is defined differently on the ranks (theirs wins)."""


class RankNames:
    """What the notebook knows of the names each rank defines itself: learnt from every
    reply (rank.Reply.names), so that the next function leaves them out; and which
    notebook names the ranks shadowed (a warning, once per name)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.by_rank: dict[int, set[str]] = {}
        self.warned: set[str] = set()

    def reset(self) -> None:
        self.by_rank = {r: set(GIVEN_NAMES) for r in range(self.world_size)}

    def clear(self) -> None:
        self.by_rank = {}

    def known(self, ranks: list[int]) -> frozenset[str]:
        """Names every one of `ranks` defines."""
        return frozenset(set.intersection(*(self.by_rank.get(r, set()) for r in ranks)))

    def lost(self) -> list[str]:
        """Names a restart would lose (not the ones every rank is given)."""
        names = set().union(*self.by_rank.values()) if self.by_rank else set()
        return sorted(names - set(GIVEN_NAMES))

    def learn(self, replies: dict) -> None:
        for r, reply in replies.items():
            if not isinstance(reply, rank_side.Reply):
                continue
            if reply.names is not None:
                self.by_rank[r] = set(reply.names) | set(GIVEN_NAMES)
            for name, value in reply.shadowed.items():
                if name not in self.warned:
                    self.warned.add(name)
                    warnings.warn(NameShadowedWarning(
                        f"the notebook's {name!r} ({value}) is not used on the ranks: "
                        f"names resolve on the ranks first, and rank {r} has its own "
                        f"{name!r}. Pass it as an argument to use the notebook's value."),
                        stacklevel=5)


def is_notebook_function(fn) -> bool:
    g = getattr(fn, "__globals__", None)
    return isinstance(g, dict) and g.get("__name__") == "__main__"


class NotebookPickler(cloudpickle.Pickler):
    """cloudpickle, with notebook functions' globals bound to the rank's namespace and
    the names in `rank_names` left out."""

    def __init__(self, file, rank_names: frozenset[str]):
        super().__init__(file, protocol=5)
        self.rank_names = rank_names
        self.left_out: dict[str, object] = {}  # name -> the notebook's value
        self._namespace_ids: set[int] = set()

    def _dynamic_function_reduce(self, func):
        reduced = super()._dynamic_function_reduce(func)
        if not is_notebook_function(func):
            return reduced
        self._namespace_ids.add(id(func.__globals__))
        maker, newargs, (state, slotstate), *rest = reduced
        kept = {}
        for name, value in slotstate["__globals__"].items():
            if name in self.rank_names:
                self.left_out[name] = value
            else:
                kept[name] = value
        slotstate["__globals__"] = kept
        return (maker, newargs, (state, slotstate), *rest)

    def persistent_id(self, obj):
        if type(obj) is dict and self._namespace_ids:
            for key in self._namespace_ids:
                if self.globals_ref.get(key) is obj:
                    return NAMESPACE_PID
        return None


class _LeftOutScalars:
    """Pickled last: by then the pickler knows which names it left out."""

    def __init__(self, pickler: NotebookPickler):
        self.pickler = pickler

    def __reduce__(self):
        values = {k: v for k, v in self.pickler.left_out.items() if isinstance(v, _SCALARS)}
        return (dict, (values,))


def dumps_for_ranks(fn, args: tuple, kwargs: dict, source, rank_names: frozenset[str]) -> bytes:
    """The payload of `lab.run`: (fn, args, kwargs, source, scalars) for rank.call_pickled."""
    out = io.BytesIO()
    pickler = NotebookPickler(out, rank_names)
    pickler.dump((fn, args, kwargs, source, _LeftOutScalars(pickler)))
    return out.getvalue()


def payload_for_run(fn, args: tuple, kwargs: dict, rank_names: frozenset[str]) -> bytes:
    """What `lab.run(fn, *args, **kwargs)` sends; a TypeError says what cannot travel."""
    for item in (fn, *args, *kwargs.values()):
        _send_by_value(item if callable(item) else type(item))
    try:
        return dumps_for_ranks(fn, args, kwargs, _source_of(fn), rank_names)
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"function {name!r} or its arguments cannot be sent to the ranks: "
                        f"{type(exc).__name__}: {exc}. Define it in the notebook or an "
                        "importable module, and pass plain data (tensors, numbers, lists) "
                        "as arguments.") from exc


def _source_of(fn) -> tuple[str, list[str]] | None:
    """fn's file name and the lines of its file up to its end (earlier lines blank), so
    that a rank's traceback shows the code (cloudpickle drops file names of code it sends
    by value). Only fn's own lines travel, not the whole file."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    last = max((line for *_, line in code.co_lines() if line), default=code.co_firstlineno)
    lines = linecache.getlines(code.co_filename)[:last]
    first = code.co_firstlineno - 1
    return code.co_filename, ["\n"] * first + lines[first:]


def _send_by_value(obj) -> None:
    """Functions and classes from the notebook (__main__) travel by value anyway; do the
    same for modules that are not installed (a test file, a helper .py next to a notebook),
    which the ranks may not be able to import."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return
    path = getattr(module, "__file__", None) or ""
    installed = any(part in path for part in ("site-packages", "dist-packages", _STDLIB))
    if path and not installed and not module.__name__.startswith("tplab"):
        cloudpickle.register_pickle_by_value(module)
