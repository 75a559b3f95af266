"""Rank side: where this rank is, written to the rendezvous store for the notebook.

A reporter thread (`report_loop`) writes `where_now()` every REPORT_INTERVAL_S while a cell
runs: computing or in which collective (tplab/rank/collectives.py notes every call), at
which line of the learner's code, and every group's collective count. At the end of a cell
that changed the counts, `end_cell` writes a final report: the notebook's word on a
finished rank's counts (tplab/lab/diagnose.py `owed`). So that word is never stale, the
reporter and the cell's start and end share `REPORT.lock` (a slow "running" write cannot
land after the final one), and the final write is acknowledged by the store before the
rank's reply leaves (tests/test_where_reports.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import linecache
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from tplab.rank.collectives import COLLECTIVE_FRAMES, REPORT, WHERE_KEY, groups_now, history

REPORT_INTERVAL_S = 0.1
# torch.compile's tracing (dynamo's bytecode interpreter, make_fx, fake tensors, inductor's
# lowering) calls the functional collectives on fake tensors: a collective frame under one
# of these is being compiled, not waited in. Read as waiting, a rank compiling a
# sequence-parallel MLP's backward (seconds: sympy) looked like a peer of a rank that really
# waits in the same all-gather, and the lab restarted both ("every rank is in the same
# collective, yet it does not complete"): the compiled SP MLP "hang" of issue 28.
# The compiler can also run INSIDE a real collective frame: a compiled model that breaks
# its graph runs DTensor's redistribute eagerly, and dynamo compiles the frames the
# collective calls (tplab's own wrapper `noted`, tplab.trace's __torch_dispatch__), up to
# its recompile limit: measured at world 2 (SP MLP under tplab.trace), 37 of 43 reports of
# "in all_gather" had dynamo's convert_frame.py inside the all-gather frame. A rank whose
# innermost frames are the compiler's is computing, wherever the collective frame is.
COMPILING = (os.path.join("torch", "_dynamo", "symbolic_convert.py"),
             os.path.join("torch", "_dynamo", "convert_frame.py"),
             os.path.join("torch", "fx", "experimental", "proxy_tensor.py"),
             os.path.join("torch", "_subclasses", "fake_tensor.py"),
             os.path.join("torch", "_inductor", ""))


def _shape_of(frame) -> list[int] | None:
    try:
        found = frame.f_locals
    except Exception:  # noqa: BLE001 - a frame in the middle of changing
        return None
    for name in ("tensor", "input", "input_tensor", "output_tensor", "self", "local_tensor"):
        try:
            shape = getattr(found.get(name), "shape", None)
            if shape is not None:
                return [int(s) for s in shape]
        except Exception:  # noqa: BLE001 - an object whose .shape raises, a symbolic size
            continue
    return None


def where_now() -> dict:
    """Snapshot of the main thread: which cell, computing or in which collective, at which
    line of the learner's code, and every group's collective count."""
    state = REPORT
    snap: dict = {"rank": state.rank, "time": time.time(), "groups": groups_now()}
    if state.cell is None:
        snap.update(state="finished", cell=state.last_cell)
        return snap
    snap.update(state="running", cell=state.cell,
                seconds=round(time.monotonic() - state.cell_started, 2))
    frame = sys._current_frames().get(state.main_thread)
    op = shape = line = None
    compiling = False
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if op is None and not compiling and code.co_name in COLLECTIVE_FRAMES \
                and "torch" in filename:
            op, shape = COLLECTIVE_FRAMES[code.co_name], _shape_of(frame)
        elif any(part in filename for part in COMPILING):
            # outside a collective frame: it is traced; inside one: the compiler runs
            # under it (see COMPILING). Either way not waited in.
            op = shape = None
            compiling = True
        if line is None and not any(part in filename for part in state.library_parts):
            # f_lineno is None in a frame that has not run yet (one dynamo is converting)
            text = linecache.getline(filename, frame.f_lineno or 0).strip()
            line = f"{filename}:{frame.f_lineno} {text}".strip()
        frame = frame.f_back
    if op is not None:
        snap.update(state="in_collective", op=op, shape=shape, history=history())
    snap["line"] = line
    return snap


def collectives_so_far() -> tuple[int, int]:
    """(groups, collectives issued on all of them so far): what a report must follow."""
    groups = list(dist.distributed_c10d._world.pg_names)
    total = 0
    for pg in groups:
        try:
            total += pg._get_sequence_number_for_group()
        except Exception:
            continue
    return len(groups), total


def report_now() -> None:
    """Write this rank's snapshot at once, and wait until the store has it (a TCPStore
    `set` is not answered; the `check` after it, on the same connection, is). At the end
    of a cell the notebook trusts a finished rank's report for its final collective
    counts, so the report must be in the store before the reply leaves."""
    if REPORT.store is not None and REPORT.reporting:
        key = WHERE_KEY.format(rank=REPORT.rank)
        try:
            REPORT.store.set(key, json.dumps(where_now()))
            REPORT.store.check([key])
        except Exception:
            pass


def begin_cell(cell: int) -> tuple[int, int]:
    """Mark `cell` as running (for the reporter); returns `collectives_so_far()`, which
    `end_cell` compares with."""
    issued = collectives_so_far()
    with REPORT.lock:
        REPORT.cell_started = time.monotonic()
        REPORT.cell = cell
    return issued


def end_cell(cell: int, issued: tuple[int, int]) -> None:
    """Mark `cell` as finished and, when the cell changed the collective counts or the
    reporter wrote a "running" report of it, write the final report. Under the lock, so
    a reporter that snapshotted the running cell (a slow `set` under load) writes before
    this, never after: a finished rank's report in the store is its last word."""
    with interrupts_held(), REPORT.lock:
        REPORT.last_cell, REPORT.cell = cell, None
        if REPORT.reported_cell == cell or collectives_so_far() != issued:
            report_now()


@contextlib.contextmanager
def interrupts_held():
    """The stop button (SIGINT) does nothing while a finished cell's final report is
    written: the cell's code is over, and an interrupt there would leave the report
    unwritten or the lock held. Off the main thread (a test) it changes nothing."""
    old = signal.getsignal(signal.SIGINT)
    if old is None or threading.current_thread() is not threading.main_thread():
        yield  # a handler Python cannot put back, or not the main thread (a test)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def report_running() -> bool:
    """One round of the reporter: write where this rank is, if a cell runs. True when it
    wrote."""
    with REPORT.lock:
        cell = REPORT.cell
        if not REPORT.reporting or cell is None or REPORT.store is None:
            return False
        if time.monotonic() - REPORT.cell_started < REPORT_INTERVAL_S:
            return False
        REPORT.store.set(WHERE_KEY.format(rank=REPORT.rank), json.dumps(where_now()))
        REPORT.reported_cell = cell
        return True


def report_loop() -> None:
    """Write where this rank is every REPORT_INTERVAL_S while a cell runs. A failed report
    (a frame that changed under us, a slow store) is retried; only a store that stays
    unreachable for 10 s (the lab is shutting down) ends the loop."""
    failures = 0
    while failures < 10 / REPORT_INTERVAL_S:
        time.sleep(REPORT_INTERVAL_S)
        try:
            report_running()
            failures = 0
        except Exception:  # noqa: BLE001 - reported on the next round
            failures += 1


def package_dirs() -> tuple[str, ...]:
    """Folders of code that is not the learner's: a hang is reported at the learner's line."""
    dirs = []
    for name in ("torch", "tplab", "ipyparallel", "IPython", "ipykernel", "zmq", "tornado"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
    return tuple(dirs)
