"""The race behind a false CollectiveHang ("No rank reported where it is" with every rank
finished): the notebook paired a rank that had just finished with an older report of it,
whose lower collective counts looked like collectives it never called. It then replayed
them on that rank, which hung there. Each side of the race is made deterministic here by
delaying one step (a reporter's store write, a rank's reply), without a lab."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tplab.lab import diagnose
from tplab.lab.watchdog import Watchdog
from tplab.rank import whereabouts
from tplab.rank.collectives import REPORT, WHERE_KEY


class SlowStore:
    """A store whose first write of a "running" report blocks until released."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.entered, self.release = threading.Event(), threading.Event()
        self.delayed = False

    def set(self, key, value):
        if not self.delayed and json.loads(value)["state"] != "finished":
            self.delayed = True
            self.entered.set()
            self.release.wait(5.0)
        self.values[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.values for k in keys)


@pytest.fixture
def report_state():
    saved = {k: getattr(REPORT, k) for k in ("rank", "store", "cell", "last_cell",
                                              "reported_cell", "reporting", "cell_started")}
    yield REPORT
    for k, v in saved.items():
        setattr(REPORT, k, v)


def test_a_slow_running_report_never_lands_after_the_final_one(report_state):
    store = report_state.store = SlowStore()
    report_state.rank, report_state.reporting = 0, True
    issued = whereabouts.begin_cell(41)
    time.sleep(whereabouts.REPORT_INTERVAL_S * 1.5)
    reporter = threading.Thread(target=whereabouts.report_running)
    reporter.start()
    assert store.entered.wait(5.0), "the reporter never wrote"
    # The cell ends while the reporter's snapshot of it is still on its way to the store.
    ender = threading.Thread(target=whereabouts.end_cell, args=(41, issued))
    ender.start()
    time.sleep(0.3)
    store.release.set()
    reporter.join(5.0)
    ender.join(5.0)
    last = json.loads(store.values[WHERE_KEY.format(rank=0)])
    assert last["state"] == "finished" and last["cell"] == 41, last


def report(rank, state, cell, seq, when):
    r = {"rank": rank, "state": state, "cell": cell, "time": when,
         "groups": {"0": {"ranks": [0, 1], "seq": seq, "desc": "default_pg"}}}
    if state == "in_collective":
        r.update(op="all_reduce", history={"0": [
            {"seq": seq, "order": 1, "kind": "c10d", "api": "all_reduce", "op": "all_reduce",
             "group_pos": 2, "args": [["T", [1], "float32"]], "kwargs": {}}]})
    return r


class LateReply:
    """RankResults for 2 ranks where rank 1's reply arrives just after the store is read."""

    ranks = [0, 1]

    def __init__(self):
        self.arrived = False

    def finished(self):
        return [1] if self.arrived else []


def test_a_reply_that_arrives_after_the_reports_are_read_is_not_a_mismatch():
    now = time.time()
    res = LateReply()
    # In the store: rank 0 waits in collective #5, which rank 1 also calls; rank 1's report
    # is still its one from the cell before (a short cell: the reporter never wrote), 4
    # collectives. Its final report (5) is written before its reply, which lands right
    # after the reports were read.
    stored = {0: report(0, "in_collective", 9, 5, now), 1: report(1, "finished", 8, 4, now)}

    def where():
        res.arrived = True
        return stored

    dog = Watchdog(2, processes=None, restart=None, rank_names=list)
    dog.where = where
    views = dog.views_now(res, 9)
    assert views[1].state != "finished"
    assert diagnose.owed(views) == {}


def test_a_finished_rank_with_a_running_report_owes_nothing_yet():
    now = time.time()
    where = {0: report(0, "in_collective", 9, 5, now), 1: report(1, "running", 9, 4, now)}
    views = diagnose.views(where, 9, [0, 1], [1], 2, now)
    assert diagnose.owed(views) == {}
    assert not diagnose.deadlocked(views)


def test_a_finished_rank_that_skipped_a_collective_owes_it():
    now = time.time()
    where = {0: report(0, "in_collective", 9, 5, now), 1: report(1, "finished", 9, 4, now)}
    views = diagnose.views(where, 9, [0, 1], [1], 2, now)
    assert diagnose.owed(views) == {(1, "0"): (4, 5)}


def _frame_in(path: str, name: str):
    """A function named `name` whose frames say they are in file `path` (a torch file)."""
    found: dict = {}
    exec(compile(f"def {name}(inner):\n    return inner()\n", path, "exec"), found)
    return found[name]


def test_a_collective_traced_by_torch_compile_is_computing_not_waiting(report_state):
    """torch.compile's tracing calls the functional collectives on fake tensors: a rank
    compiling (a compiled SP MLP's backward under tplab.trace: seconds) is not waiting,
    or a peer that really waits in the same all-gather looks deadlocked with it."""
    report_state.cell, report_state.cell_started = 1, time.monotonic()
    collective = _frame_in("/x/torch/distributed/_functional_collectives.py",
                           "all_gather_tensor")
    tracer = _frame_in("/x/torch/fx/experimental/proxy_tensor.py", "dispatch_trace")
    waited = collective(whereabouts.where_now)
    traced = tracer(lambda: collective(whereabouts.where_now))
    assert waited["state"] == "in_collective" and waited["op"] == "all_gather", waited
    assert traced["state"] == "running" and "op" not in traced, traced


def test_dynamo_compiling_inside_a_collective_frame_is_computing_not_waiting(report_state):
    """A compiled model that breaks its graph runs DTensor's all-gather eagerly, and dynamo
    compiles the frames the collective calls (tplab's wrapper, tplab.trace's
    __torch_dispatch__): the compiler is innermost, under the all-gather frame. Read as
    waiting, both ranks of a compiled SP MLP "hung" in the same all-gather (issue 28)."""
    report_state.cell, report_state.cell_started = 1, time.monotonic()
    collective = _frame_in("/x/torch/distributed/_functional_collectives.py",
                           "all_gather_tensor")
    converter = _frame_in("/x/torch/_dynamo/convert_frame.py", "_compile")
    inside = collective(lambda: converter(whereabouts.where_now))
    assert inside["state"] == "running" and "op" not in inside, inside
    # the collective on its own is still waited in
    assert collective(whereabouts.where_now)["op"] == "all_gather"
