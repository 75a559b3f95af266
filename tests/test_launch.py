"""The launcher on real rank processes: run, execute, push/pull, output, errors, magics."""

from __future__ import annotations

import time

import torch

import tplab
from tplab.core.output import format_rank_list, print_grouped


def rank_times_ten():
    import torch.distributed as dist

    return dist.get_rank() * 10


def allreduce_of_rank_plus_one(n):
    import torch.distributed as dist

    x = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    return x


class Counter:
    """A class defined in a test module, which the ranks cannot import: travels by value."""

    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self


def test_run_returns_results_in_rank_order(lab):
    assert lab.run(rank_times_ten) == [10 * r for r in range(lab.world_size)]


def test_allreduce_result_and_tensors_come_back_as_cpu_tensors(lab):
    n = lab.world_size
    results = lab.run(allreduce_of_rank_plus_one, 5)
    expected = torch.full((5,), float(n * (n + 1) // 2))
    assert all(isinstance(t, torch.Tensor) for t in results)
    for t in results:
        torch.testing.assert_close(t, expected)


def test_bfloat16_and_nested_containers_survive_the_trip(lab):
    def make():
        return {"a": [torch.arange(4, dtype=torch.bfloat16)], "b": (1, "x")}

    out = lab.run(make)[0]
    assert out["a"][0].dtype == torch.bfloat16
    assert out["a"][0].tolist() == [0, 1, 2, 3]
    assert out["b"] == (1, "x")


def test_dtensor_comes_back_as_local_shard(lab):
    def shard_rows():
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
        return distribute_tensor(full, mesh, [Shard(0)])

    shards = lab.run(shard_rows)
    n = lab.world_size
    assert all(isinstance(s, tplab.LocalShard) for s in shards)
    assert [s.coordinate for s in shards] == [(r,) for r in range(n)]
    assert all(s.placements == ("Shard(0)",) and s.global_shape == (8, 3) for s in shards)
    torch.testing.assert_close(torch.cat([s.local for s in shards]),
                               torch.arange(24, dtype=torch.float32).reshape(8, 3))
    assert [s.offsets[0] for s in shards] == [r * 8 // n for r in range(n)]


def test_classes_and_closures_travel_by_value(lab):
    offset = 7
    results = lab.run(lambda c: c.bump().value + offset, Counter(1))
    assert results == [9] * lab.world_size


def test_execute_keeps_a_namespace_and_returns_the_last_expression(lab):
    lab.execute("x = rank + 1")
    assert lab.execute("x * world_size") == [(r + 1) * lab.world_size
                                             for r in range(lab.world_size)]
    assert lab.execute("y = 3") == [None] * lab.world_size


def test_execute_on_some_ranks(lab):
    assert lab.execute("rank", ranks=[0, lab.world_size - 1]) == [0, lab.world_size - 1]


def test_push_and_pull(lab):
    lab.push({"weight": torch.ones(2, 2) * 3, "name": "w"})
    pulled = lab.pull("weight")
    assert len(pulled) == lab.world_size
    assert all(torch.equal(w, torch.ones(2, 2) * 3) for w in pulled)
    assert lab.pull("name") == ["w"] * lab.world_size


def test_pull_of_a_name_missing_on_some_ranks_names_them(lab):
    lab.execute("only_rank0 = 1 if rank == 0 else None\nif rank != 0: del only_rank0")
    try:
        lab.pull("only_rank0")
    except tplab.LabError as exc:
        assert f"not defined on {format_rank_list(range(1, lab.world_size))}" in str(exc)
    else:
        raise AssertionError("pull of a missing name did not raise")


def test_functions_that_see_rank_globals(lab):
    # A function from the notebook sees the rank's names, as a %%ranks cell does.
    lab.push({"scale": 2})
    assert lab.run(lambda: rank * scale) == [2 * r for r in range(lab.world_size)]  # noqa: F821


def test_output_identical_on_every_rank_is_shown_once(lab, capsys):
    def talk():
        import torch.distributed as dist

        print("same everywhere")
        print(f"I am rank {dist.get_rank()}")

    lab.run(talk)
    out = capsys.readouterr().out.splitlines()
    n = lab.world_size
    assert out[0] == f"[{format_rank_list(range(n))}] same everywhere"
    assert out.count(f"[{format_rank_list(range(n))}] same everywhere") == 1
    # lines that differ come as they arrive (live), each labelled by its rank
    assert sorted(out[1:]) == [f"[rank {r}] I am rank {r}" for r in range(n)]


def test_stderr_is_shown_labelled(lab, capsys):
    lab.execute("import sys; print('warn', rank, file=sys.stderr)", ranks=[1])
    assert "[rank 1] warn 1" in capsys.readouterr().err


def test_print_grouped_lines_by_position():
    import io

    buf = io.StringIO()
    print_grouped({0: "a\nb0\n", 1: "a\nb1\nc", 2: ""}, buf)
    assert buf.getvalue().splitlines() == ["[ranks 0,1] a", "[rank 0] b0", "[rank 1] b1",
                                           "[rank 1] c"]


def test_error_on_one_rank_keeps_its_traceback(lab):
    def fail_on_last():
        import torch.distributed as dist

        if dist.get_rank() == dist.get_world_size() - 1:
            raise ValueError("bad shard on the last rank")
        return "ok"

    try:
        lab.run(fail_on_last)
    except tplab.RankError as exc:
        assert exc.ranks == [lab.world_size - 1]
        tb = exc.tracebacks[lab.world_size - 1]
        assert "ValueError: bad shard on the last rank" in tb
        assert "fail_on_last" in tb and "raise ValueError" in tb
    else:
        raise AssertionError("no RankError")


def test_identical_errors_on_all_ranks_are_shown_once(lab):
    try:
        lab.execute("1 / 0")
    except tplab.RankError as exc:
        text = str(exc)
        assert exc.ranks == list(range(lab.world_size))
        assert text.count("ZeroDivisionError") == 1
        assert f"[{format_rank_list(range(lab.world_size))}]" in text
        assert "<ranks cell" in text  # the cell's own line is in the traceback
    else:
        raise AssertionError("no RankError")


def test_error_while_other_ranks_wait_in_a_collective(lab):
    """Rank 0 raises before an all-reduce the others entered: a RankError at once (not a
    hang); the waiting ranks are freed without a restart, so names survive."""
    lab.execute("kept = rank + 100")
    code = ("if rank == 0:\n    raise RuntimeError('rank 0 gave up')\n"
            "dist.all_reduce(torch.ones(4))")
    started = time.monotonic()
    try:
        lab.execute(code, timeout=30)
    except tplab.RankError as exc:
        assert time.monotonic() - started < 5
        assert exc.ranks == [0]
        waiting = "rank 1 is" if lab.world_size == 2 else f"ranks 1-{lab.world_size - 1} are"
        assert f"{waiting} in all_reduce #" in str(exc)
        assert "rank 0 finished the cell without calling it" in str(exc)
        assert "No restart was needed" in str(exc)
    else:
        raise AssertionError("no RankError")
    assert lab.pull("kept") == [r + 100 for r in range(lab.world_size)]
    assert lab.run(allreduce_of_rank_plus_one, 1)[0].item() == sum(range(1, lab.world_size + 1))


def test_unpicklable_function_is_refused_with_a_clear_error(lab):
    import threading

    lock = threading.Lock()
    try:
        lab.run(lambda: lock)
    except TypeError as exc:
        assert "cannot be sent to the ranks" in str(exc)
    else:
        raise AssertionError("an unpicklable closure was accepted")


def test_magics_through_ipython(lab, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from tplab.lab.magics import register_magics

    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # no history database left behind
    shell = InteractiveShell.instance(config=config)
    register_magics(lab)
    n = lab.world_size
    result = shell.run_cell("%%ranks\nz = rank * 2\nz")
    assert result.success
    out = capsys.readouterr().out
    assert [f"[rank {r}] {2 * r}" for r in range(n)] == out.splitlines()
    result = shell.run_cell(f"%%rank 0,{n - 1}\nprint('hi from', rank)")
    assert result.success
    out = capsys.readouterr().out.splitlines()
    # live output: lines that differ are shown as they arrive (tplab/lab/streams.py), and
    # under load rank n-1 may print first
    assert sorted(out) == ["[rank 0] hi from 0", f"[rank {n - 1}] hi from {n - 1}"]
    result = shell.run_cell("%%ranks\nraise KeyError('nope')")
    assert isinstance(result.error_in_exec, tplab.RankError)


def test_zero_dim_and_non_contiguous_tensors_keep_their_shape(lab):
    out = lab.run(lambda: (torch.tensor(3.5), torch.arange(6.0).reshape(2, 3).t()))[0]
    assert out[0].shape == () and out[0].item() == 3.5
    assert torch.equal(out[1], torch.arange(6.0).reshape(2, 3).t())


def make_three():
    return 3


def test_functions_passed_as_arguments_travel_by_value(lab):
    # make_three lives in this test file, which the ranks cannot import.
    assert lab.run(lambda f: f() + 1, make_three) == [4] * lab.world_size
    assert lab.run(lambda c: c.bump().value, c=Counter(0)) == [1] * lab.world_size


def test_a_traced_function_can_be_sent_after_the_notebook_touched_tplab_trace(lab):
    # Using tplab.trace in the notebook (as simulate does) must not stop functions that use
    # it from travelling to the ranks.
    import tplab.tracing  # noqa: F401

    assert callable(tplab.trace)

    def traced():
        with tplab.trace() as t:
            torch.distributed.all_reduce(torch.ones(2))
        return t.counts()

    assert lab.run(traced)[0]["forward"] == {"all_reduce": 1}


def test_a_plan_error_on_the_ranks_is_also_a_plan_error(lab):
    def bad_plan():
        from torch import nn
        from torch.distributed.tensor.parallel import ColwiseParallel

        model = nn.Sequential(nn.Linear(4, 8))
        mesh = tplab.make_mesh(tp=torch.distributed.get_world_size())
        tplab.apply_plan(model, mesh, {"1": ColwiseParallel()})

    try:
        lab.run(bad_plan)
    except tplab.PlanError as exc:
        assert isinstance(exc, tplab.RankError)
        assert "matches no module" in str(exc)
    else:
        raise AssertionError("no PlanError")


def _threads_here():
    import os

    import torch
    import torch._inductor.config as inductor

    return (torch.get_num_threads(), os.environ["TORCHINDUCTOR_COMPILE_THREADS"],
            inductor.compile_threads)


def test_each_rank_compiles_with_its_share_of_the_cores(lab):
    # torch.compile's own default, min(32, cores) compile workers in every rank, would start
    # a pool per rank on the same cores; a rank compiles with the threads it was given
    share = lab.threads_per_rank
    assert lab.run(_threads_here) == [(share, str(share), share)] * lab.world_size
