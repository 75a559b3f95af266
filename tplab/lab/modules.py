"""The notebook's modules on the ranks: its `sys.path`, the folder of the module a function
comes from, and reloading an edited module (`lab.reload`). Imports only the standard
library: the notebook calls `notebook_paths` and `explain_missing`, the ranks
`add_paths` and `reload_here`.

A function from a module is pickled by reference (its module's name), so a rank imports
that module itself: it finds it only when the module's folder is on the rank's sys.path.
Before a cell needs it, the lab sends the notebook's sys.path (relative entries and ""
made absolute against the notebook's working directory, which is not the ranks', least
of all on other hosts) and each rank puts the folders it lacks, where they exist on its
host, in front of its own.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

MISSING = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def notebook_paths(fn=None) -> list[str]:
    """The notebook's sys.path, absolute, with the top folder of fn's module first."""
    cwd = os.getcwd()
    paths = [os.path.abspath(os.path.join(cwd, p)) for p in sys.path if isinstance(p, str)]
    top = _top_folder(getattr(fn, "__module__", None))
    if top and top not in paths:
        paths.insert(0, top)
    return list(dict.fromkeys(paths))


def _top_folder(name: str | None) -> str | None:
    """The folder that holds module `name`'s top package (what sys.path needs for it)."""
    module = sys.modules.get(name or "")
    path = getattr(module, "__file__", None)
    if not path or name == "__main__":
        return None
    folder = os.path.dirname(os.path.abspath(path))
    depth = name.count(".") + (os.path.basename(path) == "__init__.py")
    for _ in range(depth):
        folder = os.path.dirname(folder)
    return folder


def add_paths(paths: list[str], cell: int = 0) -> list[str]:
    """On a rank: put the folders of `paths` that this rank's sys.path lacks in front of it,
    in the notebook's order, where they exist on this host. Returns those that do not."""
    absent = [p for p in paths if p not in sys.path]
    here = [p for p in absent if os.path.isdir(p)]
    sys.path[:0] = here
    if here:
        importlib.invalidate_caches()
    return [p for p in absent if p not in here]


def reload_here(name: str, cell: int = 0) -> bool:
    """On a rank: reload module `name` when this rank imported it (True), else leave it
    to be imported fresh when a call needs it (False)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    importlib.invalidate_caches()
    importlib.reload(module)
    return True


def explain_missing(traceback: str, hosts: dict[int, str], missing: dict[int, list[str]]) -> str:
    """For a rank's `No module named 'X'`, what the notebook knows: where X's file is
    here, whether its folder exists on the ranks' hosts, and what to do; "" otherwise."""
    found = MISSING.search(traceback)
    if not found:
        return ""
    name = found.group(1)
    module = sys.modules.get(name) or sys.modules.get(name.split(".")[0])
    path = getattr(module, "__file__", None)
    if not path:
        return ""
    folder = _top_folder(module.__name__)
    without = sorted({hosts.get(r, "?") for r, paths in missing.items() if folder in paths})
    where = (f"its folder {folder} does not exist on {', '.join(without)}" if without
             else f"its folder {folder} is on the ranks' sys.path")
    return (f"Module {name!r} is imported in the notebook from {path}, but the ranks cannot "
            f"import it: {where}. Make the module importable on the ranks' hosts (the same "
            f"path on a shared file system, a copy there, or pip install it into the ranks' "
            f"Python), or define the function in the notebook. After editing the module, "
            f"lab.reload({name.split('.')[0]}) loads the new code on the ranks.")
