"""`%%ranks` (run the cell on every rank) and `%%rank 0,2` (on some ranks).

The magics are registered when tplab is imported in IPython, so `%%ranks` before any
launch says how to start a lab instead of "Cell magic not found". They talk to the newest
lab that is still running.
"""

from __future__ import annotations

import weakref

from tplab.errors import LabError
from tplab.lab.validate import check_timeout, parse_rank_spec

_labs: list = []  # weak references, oldest first: the magics must not keep a lab alive


class MagicError(LabError):
    """A %%ranks / %%rank line that cannot be used; shown as one line."""


def active_lab():
    """The newest lab that is still running."""
    for ref in reversed(_labs):
        lab = ref()
        if lab is not None and not lab.closed:
            return lab
    raise MagicError("no lab is running: start one with lab = tplab.launch(world_size=4)")


def _show(results: list, ranks: list[int]) -> None:
    from tplab.lab.output import format_rank_list

    if all(r is None for r in results):
        return
    groups: dict[str, list[int]] = {}
    for r, value in zip(ranks, results, strict=True):
        if value is not None:
            groups.setdefault(repr(value), []).append(r)
    for text, rs in groups.items():
        print(f"[{format_rank_list(rs)}] {text}")


def _timeout(line: str) -> float | None:
    text = line.strip()
    if not text:
        return None
    try:
        return check_timeout(float(text), "timeout")
    except ValueError:
        raise MagicError(f"%%ranks takes an optional timeout in seconds, e.g. %%ranks 30; "
                         f"got {text!r}") from None


def ranks_magic(line: str, cell: str) -> None:
    """%%ranks [timeout]: run this cell on every rank of the newest running lab."""
    timeout = _timeout(line)
    lab = active_lab()
    _show(lab.execute(cell, timeout=timeout), list(range(lab.world_size)))


def rank_magic(line: str, cell: str) -> None:
    """%%rank 0,2 (or 0 2, or 1-3): run this cell on the given ranks only."""
    lab = active_lab()
    try:
        ranks = parse_rank_spec(line, lab.world_size)
    except ValueError as exc:
        raise MagicError(str(exc)) from None
    _show(lab.execute(cell, ranks=ranks), ranks)


def register_magics(lab=None) -> None:
    """Remember `lab` as the newest (when given), and register the magics in IPython."""
    if lab is not None:
        _labs[:] = [ref for ref in _labs if ref() is not None]
        _labs.append(weakref.ref(lab))
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    shell.register_magic_function(ranks_magic, "cell", "ranks")
    shell.register_magic_function(rank_magic, "cell", "rank")
