"""Labs that outlive their cell: re-running `lab = tplab.launch(n)` then `lab` (as the
notebooks do) rebinds `lab`, but IPython's output history (`Out[n]`, `_`, `_n`, the display
hook's `_`, `__`, `___`, their copies in `user_ns_hidden`) still holds the earlier lab, so
its processes ran until the kernel ended (12 per re-run at world 2).

After every cell (IPython's "post_run_cell" event) an earlier lab that no name of the
notebook refers to is checked: the history's references to it are taken out and, if
nothing else held it (`gc.collect()` then frees it, which runs its finalizer: every process
ended, its folder removed), it is gone and a line says so; else they are put back. An
earlier lab that a name still holds keeps running, and a line says once that two labs
run and how to end the other: never two labs by accident.
"""

from __future__ import annotations

import gc
import re
import sys
import weakref

HISTORY_NAME = re.compile(r"_+|_\d+|_i+|_ih|_oh|Out|_ii+|_iii")
_told: set[int] = set()   # ids of labs already announced as still running


def _names(ns: dict, lab) -> list[str]:
    """The notebook's own names (not the output history's) bound to `lab`."""
    return [k for k, v in list(ns.items()) if v is lab and not HISTORY_NAME.fullmatch(k)]


def _history_slots(shell, lab) -> list[tuple[object, object]]:
    """(container, key) of each reference IPython's output history holds to `lab`: a dict
    and its key, or the display hook and an attribute name."""
    ns = shell.user_ns
    # the display hook pushes `_`, `_n`... with interactive=False: into user_ns_hidden too
    slots: list[tuple[object, object]] = [
        (d, k) for d in (ns, getattr(shell, "user_ns_hidden", {}))
        for k, v in list(d.items()) if v is lab and HISTORY_NAME.fullmatch(k)]
    for out in {id(d): d for d in (ns.get("Out"), ns.get("_oh"),
                                   getattr(shell.history_manager, "output_hist", None))
                if isinstance(d, dict)}.values():
        slots += [(out, k) for k, v in list(out.items()) if v is lab]
    slots += [(shell.displayhook, a) for a in ("_", "__", "___")
              if getattr(shell.displayhook, a, None) is lab]
    result = getattr(shell, "last_execution_result", None)
    if result is not None and getattr(result, "result", None) is lab:
        slots.append((result, "result"))
    return slots


def _set(container, key, value) -> None:
    if isinstance(container, dict):
        if value is None:
            container.pop(key, None)
        else:
            container[key] = value
    else:
        setattr(container, key, value)


def _end_if_only_history_holds(shell, ref: weakref.ref) -> bool:
    """True if the lab `ref` names was held by the output history alone (it is ended)."""
    lab = ref()
    slots = _history_slots(shell, lab)
    if not slots:
        return False
    world = lab.world_size
    history = sorted({str(k) for _, k in slots if isinstance(k, int)})
    for container, key in slots:
        _set(container, key, None)
    del lab
    gc.collect()   # its cycles (bound methods) are freed: its finalizer ends the lab
    lab = ref()
    if lab is None:
        where = f"Out[{', '.join(history)}]" if history else "the output history"
        print(f"[tplab] ended an earlier lab (world_size {world}) that no name refers to "
              f"any more: only IPython's {where} held it, which would have kept its "
              "processes running until the kernel ends", file=sys.stderr, flush=True)
        return True
    for container, key in slots:
        _set(container, key, lab)
    return False


def check_earlier_labs(shell, labs: list) -> None:
    """After a cell: end earlier labs only the output history holds; say once which other
    lab still runs (see the module doc). `labs`: weak references, oldest first."""
    refs = [r for r in labs if r() is not None and not r().closed]
    if len(refs) < 2:
        return
    for ref in refs[:-1]:
        if _names(shell.user_ns, ref()) or not _end_if_only_history_holds(shell, ref):
            lab = ref()
            if lab is not None and id(lab) not in _told:
                _told.add(id(lab))
                names = _names(shell.user_ns, lab)
                which, how = ((names[0], f"{names[0]}.shutdown()") if names else
                              ("an earlier lab", "its .shutdown() (where it is held)"))
                print(f"[tplab] two labs are running in this kernel: {which} (world_size "
                      f"{lab.world_size}) is still running too; {how} ends it",
                      file=sys.stderr, flush=True)
