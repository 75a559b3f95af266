"""Cells for real work (issue: live output, limits on waiting only, names kept).

Real rank processes at world sizes 2 and 4 (the shared `lab` fixture)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout

import pytest

import tplab
from tplab.lab.streams import LiveOutput


class Recorder(io.StringIO):
    """A stdout that remembers when each write came."""

    def __init__(self):
        super().__init__()
        self.times: list[tuple[float, str]] = []

    def write(self, text):
        self.times.append((time.monotonic(), text))
        return super().write(text)

    def first(self, needle: str) -> float:
        return next(t for t, text in self.times if needle in text)


@pytest.fixture
def out():
    """A Recorder; tests install it with `with redirect_stdout(out):` (pytest resets
    sys.stdout between a test's phases)."""
    return Recorder()


def slow_printer():
    import time

    print("first line", flush=True)
    time.sleep(1.5)
    print("second line")
    return 1


def test_output_arrives_while_the_cell_runs(lab, out):
    with redirect_stdout(out):
        lab.run(slow_printer)
    ended = time.monotonic()
    ranks = f"ranks 0-{lab.world_size - 1}" if lab.world_size > 2 else "ranks 0,1"
    assert f"[{ranks}] first line" in out.getvalue()  # every rank printed it: shown once
    assert out.getvalue().count("first line") == 1
    assert ended - out.first("first line") > 1.0  # shown before the cell ended
    assert f"[{ranks}] second line" in out.getvalue()


def test_lines_that_differ_are_labelled_by_rank(lab, out):
    with redirect_stdout(out):
        lab.execute("print(f'rank {rank} says hi')\nprint('same for all')")
    text = out.getvalue()
    for r in range(lab.world_size):
        assert f"[rank {r}] rank {r} says hi" in text
    assert text.count("same for all") == 1


def test_progress_bar_is_one_line_per_rank():
    live = LiveOutput([0, 1], stdout=io.StringIO(), live=False)
    for pct in (10, 50, 100):
        live.feed([(0, "stderr", f"\r{pct}%|#"), (1, "stderr", f"\r{pct}%|#")], now=0.0)
    live.feed([(0, "stderr", "\n"), (1, "stderr", "\n")], now=0.0)
    err = live._streams["stderr"].file = io.StringIO()  # noqa: SLF001 - the test's sink
    live.flush(now=1.0, final=True)
    assert err.getvalue() == "[ranks 0,1] 100%|#\n"


def test_progress_bar_updates_one_display_in_a_kernel(monkeypatch):
    shown = []

    class Handle:
        def update(self, data, raw=True):
            shown.append(("update", data["text/plain"]))

    def display(data, raw=True, display_id=True):
        shown.append(("display", data["text/plain"]))
        return Handle()

    import IPython.display

    monkeypatch.setattr(IPython.display, "display", display)
    live = LiveOutput([0], stdout=io.StringIO(), stderr=io.StringIO(), live=True)
    for i, pct in enumerate((10, 50, 100)):
        live.feed([(0, "stderr", f"\r{pct}%")], now=float(i))
    live.feed([(0, "stderr", "\n")], now=5.0)
    assert shown == [("display", "[rank 0] 10%"), ("update", "[rank 0] 50%"),
                     ("update", "[rank 0] 100%"), ("update", "[rank 0] 100%")]


def test_compute_longer_than_timeout_is_not_a_hang(lab):
    assert lab.execute("import time\ntime.sleep(3)\nrank", timeout=1) == list(range(lab.world_size))


def test_peer_computing_longer_than_timeout_is_waited_for(lab):
    code = ("import time\nx = torch.ones(2)\nif rank == 1:\n    time.sleep(3)\n"
            "dist.all_reduce(x)\nx[0].item()")
    assert lab.execute(code, timeout=1) == [float(lab.world_size)] * lab.world_size


def test_lines_printed_before_a_hang_are_shown(lab, out):
    with redirect_stdout(out), pytest.raises(tplab.CollectiveHang):
        lab.execute("print('before the hang')\nif rank == 0:\n    dist.barrier()")
    assert "before the hang" in out.getvalue()


def test_lines_printed_before_a_crash_are_shown(lab, out):
    with redirect_stdout(out), pytest.raises(tplab.RankDied):
        lab.execute("import os\nprint('before the crash', flush=True)\nif rank == 1:\n"
                    "    os._exit(7)\ndist.barrier()")
    assert "before the crash" in out.getvalue()


def test_cell_timeout_interrupts_and_keeps_names(lab, out):
    lab.execute("kept = rank + 1")
    started = time.monotonic()
    with redirect_stdout(out), pytest.raises(tplab.CellTimeout) as info:
        lab.execute("import time\nprint('started')\ntime.sleep(30)", cell_timeout=1.5)
    assert time.monotonic() - started < 8
    assert isinstance(info.value, tplab.LabError)
    assert "cell_timeout=1.5 s" in str(info.value) and "computing" in str(info.value)
    assert "time.sleep(30)" in str(info.value)  # what each rank was doing
    assert "started" in out.getvalue()
    assert lab.pull("kept") == [r + 1 for r in range(lab.world_size)]


def test_status_line_while_a_rank_waits_for_a_computing_peer(lab, monkeypatch):
    from tplab.lab import cell_watch, streams

    lines = []
    monkeypatch.setattr(streams.StatusLine, "show", lambda self, text: lines.append(text))
    monkeypatch.setattr(cell_watch, "STATUS_AFTER_S", 0.5)
    code = "import time\nif rank == 1:\n    time.sleep(2)\ndist.barrier()"
    lab.execute(code)
    assert any("waiting in barrier" in t and "for rank 1, computing at" in t
               and "time.sleep(2)" in t for t in lines), lines


def test_collective_on_a_mesh_dimension_is_freed(labs):
    lab = labs.get(4)
    lab.execute("mesh = tplab.make_mesh(dp=2, tp=2)\nkept = rank")
    code = ("g = mesh.get_group('tp')\nx = torch.ones(3)\n"
            "if mesh.get_local_rank('tp') == 0:\n    dist.all_reduce(x, group=g)")
    with pytest.raises(tplab.CollectiveHang) as info:
        lab.execute(code)
    assert info.value.restarted is False
    assert "mesh dim 'tp'" in str(info.value)
    assert lab.pull("kept") == [0, 1, 2, 3]


def test_dtensor_redistribution_on_some_ranks_is_freed(labs):
    lab = labs.get(2)
    lab.execute("from torch.distributed.tensor import distribute_tensor, Shard, Replicate\n"
                "m = tplab.make_mesh(tp=2)\nd = distribute_tensor(torch.ones(4, 2), m, [Shard(0)])")
    with pytest.raises(tplab.CollectiveHang) as info:
        lab.execute("if rank == 0:\n    d.redistribute(m, [Replicate()]).to_local()")
    assert info.value.restarted is False
    assert lab.execute("d.full_tensor().sum().item()") == [8.0, 8.0]


# 32 ranks on 2 cores take minutes to register (30 of 32 within 164 s once): extended
@pytest.mark.parametrize("n", [16, pytest.param(32, marks=pytest.mark.extended)])
def test_many_ranks_start(n):
    with tplab.launch(n) as lab:
        assert lab.run(lambda: (dist.all_reduce(t := torch.ones(1)), t.item())[1]) == [float(n)] * n  # noqa: F821


# --- grouping under load: by line order, with a window that follows the lag seen -------
# (a synthetic clock: `now` is given, so no real timing is involved)


def _say_hi(live, ranks, now):
    live.feed([(r, "stdout", f"rank {r} says hi\nsame for all\n") for r in ranks], now=now)


def test_a_rank_behind_in_line_order_is_waited_for():
    """Ranks 0-2 print, rank 3 (on a loaded machine) prints the same 0.9 s later: one
    `[ranks 0-3] same for all`, never `[ranks 0-2] ...` then `[rank 3] ...`."""
    out = io.StringIO()
    live = LiveOutput(range(4), stdout=out, stderr=io.StringIO(), live=False)
    _say_hi(live, [0, 1, 2], now=0.0)
    for t in (0.1, 0.5, 0.85):
        live.flush(now=t)
    assert "same for all" not in out.getvalue()  # rank 3 has not got there yet
    _say_hi(live, [3], now=0.9)
    live.flush(now=0.95)
    live.flush(now=2.0, final=True)
    text = out.getvalue()
    assert text.count("same for all") == 1 and "[ranks 0-3] same for all" in text, text
    assert "[rank 3] rank 3 says hi" in text


def test_the_window_grows_with_the_lag_seen():
    out = io.StringIO()
    live = LiveOutput(range(2), stdout=out, stderr=io.StringIO(), live=False)
    live.feed([(0, "stdout", "step 0\n")], now=0.0)
    live.flush(now=0.5)
    live.feed([(1, "stdout", "step 0\n")], now=0.8)  # a lag of 0.8 s
    live.flush(now=0.8)
    live.feed([(0, "stdout", "step 1\n")], now=1.0)
    for t in (1.5, 2.5, 3.0):  # past the 1 s window; within 4 x the lag seen
        live.flush(now=t)
    live.feed([(1, "stdout", "step 1\n")], now=3.2)
    live.flush(now=3.2)
    live.flush(now=9.0, final=True)
    assert out.getvalue() == "[ranks 0,1] step 0\n[ranks 0,1] step 1\n", out.getvalue()


def test_a_rank_past_the_line_does_not_hold_it_back():
    """Rank 1 printed its line (a different one) already: rank 0's line is shown at the
    short window, not held for the long one."""
    out = io.StringIO()
    live = LiveOutput(range(2), stdout=out, stderr=io.StringIO(), live=False)
    live.feed([(1, "stdout", "only rank 1\n")], now=0.0)
    live.flush(now=0.1)
    live.feed([(0, "stdout", "only rank 0\n")], now=0.2)
    live.flush(now=0.3)
    assert out.getvalue() == "[rank 1] only rank 1\n[rank 0] only rank 0\n", out.getvalue()


@pytest.mark.slow
def test_grouping_holds_beside_a_cpu_hog(lab, out):
    """Busy processes (four per core, started and ended here by pid) beside the ranks: every
    line the ranks print alike is still shown once, labelled with all of them."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(4 * (os.cpu_count() or 2))]
    try:
        with redirect_stdout(out):
            lab.execute("for i in range(4):\n"
                        "    print(f'rank {rank} says hi {i}', flush=True)\n"
                        "    work = sum(range(200_000))  # ranks drift apart under load\n"
                        "    print(f'same for all {i}', flush=True)")
    finally:
        for hog in hogs:
            os.kill(hog.pid, signal.SIGKILL)
            hog.wait()
    text = out.getvalue()
    ranks = f"ranks 0-{lab.world_size - 1}" if lab.world_size > 2 else "ranks 0,1"
    for i in range(4):
        assert text.count(f"same for all {i}") == 1, text
        assert f"[{ranks}] same for all {i}" in text, text
        for r in range(lab.world_size):
            assert f"[rank {r}] rank {r} says hi {i}" in text, text
