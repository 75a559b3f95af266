"""Robust under misuse: names resolve on the ranks, output below Python, results in
pytrees, clear errors for what cannot be sent, argument and magic checks.

After each finding the same check: the lab answers an all-reduce (and `test_faults.py`
and `test_lifecycle.py` check that nothing leaks)."""

from __future__ import annotations

import collections
import dataclasses
import io
import warnings
from contextlib import redirect_stdout

import pytest

import tplab


def allreduce_ok(lab) -> None:
    n = lab.world_size
    assert lab.execute("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [float(n)] * n


def notebook(source: str) -> dict:
    """Run `source` as a notebook cell would: its functions live in `__main__`."""
    ns = {"__name__": "__main__"}
    exec(compile(source, "<notebook cell>", "exec"), ns)
    return ns


def test_rank_names_win_over_the_notebook(lab):
    ns = notebook("import torch\nrank = 3\nworld_size = 99\n"
                  "def mine():\n    return (torch.ones(2) * rank).tolist(), world_size\n")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = lab.run(ns["mine"])
    assert got == [([float(r)] * 2, lab.world_size) for r in range(lab.world_size)]
    allreduce_ok(lab)


def test_a_shadowed_notebook_name_is_named_once():
    with tplab.launch(2) as lab:
        ns = notebook("world_size = 99\ndef f():\n    return world_size\n")
        with pytest.warns(UserWarning, match="the notebook's 'world_size' \\(99\\)") as got:
            lab.run(ns["f"])
            lab.run(ns["f"])
        assert len([w for w in got if "world_size" in str(w.message)]) == 1


def test_pushed_names_are_not_sent_again(lab):
    import torch

    from tplab.lab.names import dumps_for_ranks

    big = torch.ones(1_000_000)  # 4 MB in the notebook
    lab.push({"w": big * 2})
    ns = notebook("def total():\n    return w.sum().item()\n")
    ns["w"] = big
    assert lab.run(ns["total"]) == [2e6] * lab.world_size  # the rank's w wins
    known = lab.names.known([0])
    assert "w" in known
    payload = dumps_for_ranks(ns["total"], (), {}, None, known)
    assert len(payload) < 10_000  # w stayed home


def test_global_assignment_stays_on_the_rank(lab):
    ns = notebook("counter = 0\ndef bump():\n    global counter\n    counter = counter + 1\n"
                  "    return counter\n")
    assert lab.run(ns["bump"]) == [1] * lab.world_size
    assert lab.pull("counter") == [1] * lab.world_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert lab.run(ns["bump"]) == [2] * lab.world_size  # the rank's counter, not 0


def test_notebook_helpers_are_refreshed(lab):
    ns = notebook("def helper():\n    return 1\ndef use():\n    return helper()\n")
    assert lab.run(ns["use"]) == [1] * lab.world_size
    exec("def helper():\n    return 2\n", ns)
    assert lab.run(ns["use"]) == [2] * lab.world_size


def test_output_below_python_reaches_the_notebook(lab):
    out = io.StringIO()
    code = ("import os, subprocess, sys, threading\nos.write(1, b'from fd one\\n')\n"
            "subprocess.run(['echo', 'from a subprocess'])\n"
            "sys.__stdout__.write('from dunder stdout\\n'); sys.__stdout__.flush()\n"
            "t = threading.Thread(target=lambda: print('from a thread'))\nt.start(); t.join()")
    with redirect_stdout(out):
        lab.execute(code)
    text = out.getvalue()
    for needle in ("from fd one", "from a subprocess", "from dunder stdout", "from a thread"):
        assert needle in text, text
    allreduce_ok(lab)


Pair = collections.namedtuple("Pair", "shard value")


@dataclasses.dataclass
class Box:
    shard: object
    n: int = 1


def test_dtensors_in_namedtuples_and_dataclasses_come_back_as_local_shards(lab):
    def make():
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = tplab.make_mesh(tp=dist.get_world_size())  # noqa: F821
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])  # noqa: F821
        return Pair(d, 1), Box(d), {"list": [d]}

    for pair, box, tree in lab.run(make):
        for shard in (pair.shard, box.shard, tree["list"][0]):
            assert isinstance(shard, tplab.LocalShard)
            assert shard.placements == ("Shard(0)",) and shard.global_shape == (4, 2)
    allreduce_ok(lab)


def test_a_result_that_cannot_be_sent_names_rank_path_and_type(lab, capfd):
    last = lab.world_size - 1
    with pytest.raises(tplab.RankError) as info:
        lab.execute(f"import threading\nprint('printed first')\n"
                    f"{{'ok': 1, 'lock': threading.Lock() if rank == {last} else 0}}")
    assert info.value.ranks == [last]
    assert "result['lock'] is a _thread.lock" in str(info.value)
    assert "printed first" in capfd.readouterr().out
    allreduce_ok(lab)


def test_an_exception_that_cannot_be_printed_still_shows_its_traceback(lab):
    code = ("class Bad(Exception):\n    def __str__(self):\n        raise ValueError('no')\n"
            "def deep():\n    raise Bad()\ndeep()")
    with pytest.raises(tplab.RankError) as info:
        lab.execute(code)
    assert "in deep" in str(info.value) and "Bad" in str(info.value)
    allreduce_ok(lab)


def test_sparse_and_meta_results(lab):
    sparse = lab.execute("torch.eye(3).to_sparse()")
    assert all(s.is_sparse and s.to_dense().trace().item() == 3.0 for s in sparse)
    with pytest.raises(tplab.RankError, match="a meta tensor"):
        lab.execute("torch.empty(2, device='meta')")
    allreduce_ok(lab)


def test_collective_on_ranks_not_asked_is_named(labs):
    lab = labs.get(4)
    with pytest.raises(tplab.CollectiveHang) as info:
        lab.run(lambda: dist.all_reduce(torch.ones(1)), ranks=[0, 1])  # noqa: F821
    assert "ranks 2,3 were not asked to run this cell" in str(info.value)
    assert info.value.restarted is False
    allreduce_ok(lab)


def test_ranks_come_back_in_the_order_asked(lab):
    assert lab.run(lambda: rank, ranks=[1, 0]) == [1, 0]  # noqa: F821
    with pytest.raises(TypeError, match="ranks must be"):
        lab.run(lambda: 1, ranks=True)
    with pytest.raises(ValueError, match="twice"):
        lab.run(lambda: 1, ranks=[1, 1])


def test_breakpoint_on_a_rank_says_why_it_does_nothing(lab, capfd):
    lab.execute("breakpoint()")
    assert "breakpoint() cannot stop a rank" in capfd.readouterr().err


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda: tplab.launch(2, timout=2), TypeError,
     "unknown keyword 'timout'; did you mean 'timeout'"),
    (lambda: tplab.launch(2, threads_per_rank=0), ValueError, "threads_per_rank must be"),
    (lambda: tplab.launch(2, ip="10.255.255.1"), tplab.LabError, "not an address of this machine"),
    (lambda: tplab.launch(2, cluster_options=[1]), TypeError, "cluster_options must be a dict"),
    (lambda: tplab.simulate(2.5), TypeError, "world_size must be an int"),
    (lambda: tplab.simulate("4"), TypeError, "world_size must be an int"),
    (lambda: tplab.simulate(True), TypeError, "world_size must be an int"),
    (lambda: tplab.simulate(2).run(lambda: 1, ranks=[9]), ValueError, "ranks must be rank numbers"),
])
def test_arguments_are_checked(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def test_magics_reach_the_newest_running_lab_and_speak_in_one_line():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from tplab.lab.magics import MagicError, register_magics

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    register_magics()
    old = tplab.launch(2)
    new = tplab.launch(2)
    try:
        new.shutdown()
        out = io.StringIO()
        with redirect_stdout(out):
            shell.run_cell_magic("rank", "1 0", "rank")
            shell.run_cell_magic("ranks", "", "x = !echo hi\nx[0]")
        assert "[rank 1] 1" in out.getvalue() and "[rank 0] 0" in out.getvalue()
        assert "'hi'" in out.getvalue()
        for line, words in [("9", "no rank 9"), ("3-1", "runs backwards"), ("abc", "%%rank 0,2")]:
            with pytest.raises(MagicError, match=words):
                shell.run_cell_magic("rank", line, "1")
        with pytest.raises(MagicError, match="optional timeout in seconds"):
            shell.run_cell_magic("ranks", "abc", "1")
    finally:
        old.shutdown()
        new.shutdown()


def test_results_in_flight_are_not_thrown_away(labs):
    lab = labs.get(2)
    lab.execute("kept = 1")
    got = lab.execute("torch.ones(64 * 2**20 // 4)", timeout=0.2)  # 64 MB per rank
    assert [g.numel() for g in got] == [16 * 2**20] * 2
    assert lab.pull("kept") == [1, 1]


def test_magics_exist_before_any_launch():
    import subprocess
    import sys

    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "from traitlets.config import Config\nc = Config()\n"
            "c.HistoryManager.hist_file = ':memory:'\n"
            "shell = InteractiveShell.instance(config=c)\nimport tplab\n"
            "r = shell.run_cell('%%ranks\\n1')\nprint(type(r.error_in_exec).__name__, "
            "r.error_in_exec)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert "MagicError no lab is running: start one with lab = tplab.launch" in out, out
