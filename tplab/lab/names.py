"""Sending a notebook function to the ranks so that names resolve on the ranks first.

cloudpickle sends a function defined in the notebook (`__main__`) by value, with every
global it uses copied from the notebook. Left alone, the notebook's `rank` (a loop
variable), `world_size` (a parameters cell) or a pushed 256 MB `w` would travel with every
call and silently win over the rank's own. Here:
- the function's globals become the rank's namespace (tplab/lab/rank.py loads them into
  it), so a `global` assignment stays on the rank, as in a %%ranks cell;
- names the ranks are known to define are left out of the pickle (they are not sent
  at all); plain numbers and strings among them travel on the side, so the rank can say
  when the notebook's value differs from its own (a warning, once per name);
- every other name the function uses travels from the notebook, as before.
"""

from __future__ import annotations

import io

import cloudpickle

from tplab.lab.rank import NAMESPACE_PID

_SCALARS = (bool, int, float, str, type(None))


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
