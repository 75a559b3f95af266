"""What the curriculum's notebooks share beyond the public API: the world sizes each runs at.

A notebook's dimensions (heads, hidden sizes, the vocabulary, a 2-D mesh) must divide by
the world size; a size that does not fit fails in its first cell, with the sizes it can use,
rather than deep inside with a shape error.
"""

from __future__ import annotations

from tplab.errors import LabError

# notebook -> the world sizes it runs at; tests/test_notebooks.py runs each at every one
# (world 2 in the default run, the others extended), the browser test at 2 simulated
SIZES: dict[str, tuple[int, ...]] = {
    "00": (1, 2, 3, 4, 8), "01": (2, 4), "02": (2, 4), "03": (2, 4), "04": (2, 4),
    "05": (2, 4), "06": (2, 4, 6, 8), "07": (2, 4), "08": (2, 4), "09": (2, 4), "10": (2, 4),
    "11": (2, 4),
    "12": (2, 4),
    "13": (4,),  # a (dp=2, tp=2) mesh: FSDP2 across, TP inside
    "14": (2, 4),  # frameworks' own TP (tplab.frameworks)
}


def require_world_size(notebook: str, world_size) -> int:
    """`world_size` if notebook `notebook` ("00" to "14") runs at it, else a LabError that
    names the sizes it can use."""
    sizes = SIZES[notebook]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size not in sizes:
        if len(sizes) == 1:
            names, which = f"{sizes[0]} only", f"to {sizes[0]}"
        else:
            names, which = ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}", "to one of them"
        raise LabError(f"notebook {notebook} runs at world_size {names}, not {world_size!r}: "
                       f"set world_size in its first cell (the parameters) {which}")
    return world_size
