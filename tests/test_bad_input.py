"""Bad input gets a clear error naming the argument and what is valid, before anything starts."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import psutil
import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import tplab
from tplab import megatron, models, plans


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"world_size": 0}, tplab.LabError, "world_size must be at least 1, got 0"),
    ({"world_size": -2}, tplab.LabError, "world_size must be at least 1"),
    ({"world_size": 4096}, tplab.LabError, "world_size=4096 is more than this machine can run"),
    ({"world_size": "4"}, TypeError, "world_size must be an int"),
    ({"world_size": 2.0}, TypeError, "world_size must be an int"),
    ({"world_size": 2, "backend": "mpi"}, tplab.LabError,
     "unknown backend 'mpi': use one of 'auto', 'gloo', 'nccl'"),
    ({"world_size": 2, "engines": "bogus"}, tplab.LabError, "unknown engines 'bogus'"),
    ({"world_size": 2, "timeout": 0}, ValueError, "timeout must be a positive number"),
    ({"world_size": 2, "timeout": -1}, ValueError, "timeout must be a positive number"),
    ({"world_size": 2, "timeout": "10"}, ValueError, "timeout must be a positive number"),
    ({"world_size": 2, "ip": ""}, tplab.LabError, "ip must be an address"),
])
def test_launch_refuses_bad_arguments_before_starting_anything(kwargs, error, words):
    before = children()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        tplab.launch(**kwargs)
    assert children() == before


def test_unknown_engines_lists_the_valid_launchers():
    with pytest.raises(tplab.LabError) as info:
        tplab.launch(2, engines="bogus")
    assert "'local'" in str(info.value) and "mpi" in str(info.value)


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 2, reason="machine has GPUs")
def test_nccl_without_enough_gpus():
    before = children()
    with pytest.raises(tplab.LabError, match="backend='nccl' needs one GPU per rank"):
        tplab.launch(2, backend="nccl")
    assert children() == before


def test_bad_call_arguments_are_refused(labs):
    lab = labs.get(2)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        lab.run(lambda: 1, timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        lab.execute("1", timeout=-5)
    with pytest.raises(TypeError, match="needs a function"):
        lab.run("not a function")
    with pytest.raises(TypeError, match="needs code as a string"):
        lab.execute(lambda: 1)
    with pytest.raises(ValueError, match="ranks must be rank numbers from 0 to 1, got \\[5\\]"):
        lab.execute("1", ranks=[5])
    with pytest.raises(TypeError, match="needs a dict"):
        lab.push(["x"])
    assert lab.run(lambda: 2) == [2, 2]  # nothing was changed


@pytest.mark.parametrize(("line", "ranks"), [
    ("0", [0]), ("0,2", [0, 2]), ("0 2", [0, 2]), ("1 0", [1, 0]), ("0, 2-3", [0, 2, 3]),
    (" 1-3 ", [1, 2, 3]),
])
def test_rank_spec_forms(line, ranks):
    from tplab.lab.arguments import parse_rank_spec

    assert parse_rank_spec(line, 4) == ranks


@pytest.mark.parametrize(("line", "words"), [
    ("zero", "%%rank takes rank numbers, got 'zero': use %%rank 0,2 or %%rank 0 2 or %%rank 1-3"),
    ("9", "this lab has ranks 0 to 3 (no rank 9)"),
    ("3-1", "range '3-1' runs backwards: write 1-3"),
    ("", "%%rank needs the ranks to run on"),
    ("-1", "%%rank takes rank numbers"),
])
def test_magic_with_bad_ranks_names_the_problem(line, words):
    from tplab.lab.arguments import parse_rank_spec

    with pytest.raises(ValueError) as info:
        parse_rank_spec(line, 4)
    assert words in str(info.value)


def test_each_kind_checks_the_size_it_can_run():
    from tplab.lab.engines import kind_for

    # local ranks: this machine's memory and GPUs decide, before anything starts
    with pytest.raises(tplab.LabError, match="world_size=4096 is more than this machine"):
        kind_for("local").check_size(4096, "gloo")
    kind_for("local").check_size(1, "gloo")
    # ranks on other hosts: this machine's memory says nothing about them
    kind_for("mpi").check_size(4096, "nccl")


class NoRanks:
    """A lab whose ranks must not be reached: the plan is refused before."""

    world_size, closed, in_process, backend = 2, False, True, "simulated"
    threads_per_rank = shared_dir = None
    rank_pids: list[int] = []

    def run(self, *args, **kwargs):
        raise AssertionError("the ranks were asked to run")

    # the rest of tplab.lab.contract.Ranks: none may be called either
    execute = push = pull = reload = restart = shutdown = time_limit = run


BAD_PLANS = [
    (None, "plan is a NoneType"),
    ("colwise", "plan is a str ('colwise')"),
    ([("w1", ColwiseParallel()), ("w2", RowwiseParallel())], "a list of pairs"),
    (ColwiseParallel, "the class ColwiseParallel, not a style: write ColwiseParallel()"),
    (ColwiseParallel(), "a plan maps module paths to styles"),
    ({"w1": ColwiseParallel, "w2": RowwiseParallel()}, "plan['w1'] is the class ColwiseParallel"),
    ({"w1": "colwise", "w2": "rowwise"}, "plan['w1'] is the string 'colwise'"),
    ({1: ColwiseParallel()}, "a key 1 (int)"),
    (lambda model: model, "cannot be called as plan(model, mesh)"),
]


@pytest.mark.parametrize(("plan", "words"), BAD_PLANS)
@pytest.mark.parametrize("tool", ["grad_check", "train_check", "parallelizer"])
def test_a_plan_of_the_wrong_type_is_refused_in_one_line_before_the_ranks(tool, plan, words):
    cfg = models.Config(dim=16, hidden_dim=32, seq_len=4, batch_size=2)
    build = functools.partial(models.MLP, cfg)
    with pytest.raises(tplab.PlanError) as info:
        if tool == "grad_check":
            tplab.grad_check(NoRanks(), build, plan, functools.partial(models.make_input, cfg))
        elif tool == "train_check":
            tplab.train_check(NoRanks(), build, plan, lambda i: models.make_input(cfg), steps=2)
        else:
            plans.parallelizer(plan)
    text = str(info.value)
    assert words in text and "\n" not in text, text
    assert not isinstance(info.value, tplab.RankError)


def test_parallelizer_gives_the_function_that_applies_a_plan():
    cfg = models.Config(dim=16, hidden_dim=32, seq_len=4, batch_size=2)
    assert plans.parallelizer(megatron.parallelize) is megatron.parallelize
    sim = tplab.simulate(2)
    report = tplab.grad_check(sim, functools.partial(models.MLP, cfg), plans.mlp(),
                              functools.partial(models.make_input, cfg))
    assert report.ok


@pytest.mark.parametrize(("tp", "words"), [
    (0, "at least 1, got 0"), ("2", "not a str ('2')"), (None, "give tp="),
    (True, "not a bool"), (2.0, "not a float"),
])
def test_check_plan_checks_tp(tp, words):
    cfg = models.Config(dim=16, hidden_dim=32, seq_len=4, batch_size=2)
    with pytest.raises(tplab.PlanError, match=re.escape(words)):
        plans.check_plan(models.MLP(cfg), plans.mlp(), tp)
    with pytest.raises(tplab.PlanError, match="give tp="):
        plans.check_plan(models.MLP(cfg), plans.mlp())
    plans.check_plan(models.MLP(cfg), plans.mlp(), 2)


def test_the_readmes_plan_check_is_callable_as_written():
    # in a fresh process: `import tplab` alone must give tplab.plan_check
    code = "import tplab; print(callable(tplab.plan_check.check_layouts))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
    cfg = models.Config(dim=16, hidden_dim=32, seq_len=4, batch_size=2)
    edges = tplab.plan_check.check_layouts(models.MLP(cfg), plans.mlp(), models.make_input(cfg))
    assert [e.consumer for e in edges] == ["w1", "w2"]
    with pytest.raises(tplab.PlanError, match="w1 .ColwiseParallel. hands w2"):
        tplab.plan_check.check_plan(models.MLP(cfg), {"w1": ColwiseParallel(),
                                                      "w2": ColwiseParallel()}, 2,
                                    models.make_input(cfg))
