"""`%%ranks` (run the cell on every rank) and `%%rank 0,2` (on some ranks).

The magics are registered when tplab is imported in IPython, so `%%ranks` before any
launch says how to start a lab instead of "Cell magic not found". They talk to the newest
lab that is still running. As in IPython, a cell that ends in `;` shows no value; what a
rank `display(...)`s is shown after the cell, labelled by rank (tplab/lab/displays.py).
"""

from __future__ import annotations

import weakref

from IPython import get_ipython
from IPython.core.displayhook import DisplayHook

from tplab.errors import LabError, format_rank_list
from tplab.lab.arguments import check_timeout, parse_rank_spec
from tplab.lab.orphans import check_earlier_labs

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


def quiet(cell: str) -> bool:
    """True when the cell ends in `;`: as in IPython, its value is not shown (IPython's own
    test, DisplayHook.semicolon_at_end_of_expression)."""
    try:
        return DisplayHook.semicolon_at_end_of_expression(cell)
    except Exception:  # noqa: BLE001 - code tokenize cannot read: the ranks will say why
        return False


def _run(lab, cell: str, **options) -> list:
    """The cell on the ranks; a cell that ends in `;` ends in a statement there, so its
    value is neither shown nor sent back (a value that cannot travel does not fail)."""
    if quiet(cell):
        cell = cell + "\npass"
    return lab.execute(cell, **options)


def ranks_magic(line: str, cell: str) -> None:
    """%%ranks [timeout]: run this cell on every rank of the newest running lab."""
    timeout = _timeout(line)
    lab = active_lab()
    _show(_run(lab, cell, timeout=timeout), list(range(lab.world_size)))


def rank_magic(line: str, cell: str) -> None:
    """%%rank 0,2 (or 0 2, or 1-3): run this cell on the given ranks only."""
    lab = active_lab()
    try:
        ranks = parse_rank_spec(line, lab.world_size)
    except ValueError as exc:
        raise MagicError(str(exc)) from None
    _show(_run(lab, cell, ranks=ranks), ranks)


def register_magics(lab=None) -> None:
    """Remember `lab` as the newest (when given), and register the magics in IPython."""
    if lab is not None:
        _labs[:] = [ref for ref in _labs if ref() is not None]
        _labs.append(weakref.ref(lab))
    shell = get_ipython()
    if shell is None:
        return
    if not getattr(shell, "_tplab_checks_earlier_labs", False):   # once per shell
        shell.events.register("post_run_cell", lambda result: check_earlier_labs(shell, _labs))
        shell._tplab_checks_earlier_labs = True
    shell.register_magic_function(ranks_magic, "cell", "ranks")
    shell.register_magic_function(rank_magic, "cell", "rank")
