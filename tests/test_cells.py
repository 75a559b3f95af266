"""Cells for real work (issue: live output, limits on waiting only, names kept).

Real rank processes at world sizes 2 and 4 (the shared `lab` fixture)."""

from __future__ import annotations

import io
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
