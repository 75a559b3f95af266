"""`%%ranks` (run the cell on every rank) and `%%rank 0,2` (on some ranks)."""

from __future__ import annotations

import weakref

from tplab.errors import LabError

_active = {"lab": None}  # a weak reference: the magics must not keep a lab alive


def active_lab():
    ref = _active["lab"]
    lab = ref() if ref is not None else None
    if lab is None or lab._closed:
        raise LabError("no lab is running: start one with lab = tplab.launch(world_size=4)")
    return lab


def _parse_ranks(line: str) -> list[int]:
    ranks = []
    for part in line.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-")
                ranks.extend(range(int(lo), int(hi) + 1))
            else:
                ranks.append(int(part))
        except ValueError:
            raise LabError(f"%%rank takes rank numbers such as 0 or 0,2 or 1-3, "
                           f"got {line!r}") from None
    if not ranks:
        raise LabError("%%rank needs the ranks to run on, e.g. %%rank 0 or %%rank 0,2")
    return ranks


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


def ranks_magic(line: str, cell: str) -> None:
    """%%ranks [timeout]: run this cell on every rank of the active lab."""
    lab = active_lab()
    timeout = float(line) if line.strip() else None
    _show(lab.execute(cell, timeout=timeout), list(range(lab.world_size)))


def rank_magic(line: str, cell: str) -> None:
    """%%rank 0,2: run this cell on the given ranks only."""
    lab = active_lab()
    ranks = sorted(set(_parse_ranks(line)))
    _show(lab.execute(cell, ranks=ranks), ranks)


def register_magics(lab) -> None:
    """Make `lab` the one %%ranks talks to, and register the magics in IPython."""
    _active["lab"] = weakref.ref(lab)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    shell.register_magic_function(ranks_magic, "cell", "ranks")
    shell.register_magic_function(rank_magic, "cell", "rank")
