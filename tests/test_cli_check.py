"""`python -m tplab check` exit codes (0 ok, 1 failed, 2 bad arguments) and the
`tplab.testing` pytest fixture, each run as a user's CI would: in a fresh process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))


def check(*args, cwd=HERE):
    return subprocess.run([sys.executable, "-m", "tplab", "check", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_check_passes_and_fails_with_its_exit_code():
    ok = check("cli_targets:build", "tplab.plans:mlp", "cli_targets:make_input",
               "--world-size", "2", "--simulated", "--loss", "cli_targets:loss")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "grad_check on 2 ranks" in ok.stdout and ": ok," in ok.stdout


@pytest.mark.slow
def test_a_correct_bf16_model_passes_at_the_default_tolerances(capsys):
    """--atol/--rtol left out follow the model's dtype (grad_check's TOLERANCES): a correct
    bf16 MLP passes, and the report names the dtype; fp32's tolerances fail it."""
    bf16 = args_for(build=T + "build_bf16", make_input=T + "make_input_bf16",
                    extra=("--simulated",))
    assert cli(*bf16) == 0, capsys.readouterr().out
    assert "bfloat16" in capsys.readouterr().out
    assert cli(*bf16, "--atol", "1e-5", "--rtol", "1e-4") == 1


def test_check_on_rank_processes_imports_the_targets_there_too():
    bad = check("cli_targets:build", "cli_targets:broken", "cli_targets:make_input",
                "--world-size", "2")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED: input gradient wrong" in bad.stdout


@contextlib.contextmanager
def in_process():
    """main() as the command line runs it, here: from tests/, its path changes undone."""
    saved = (os.getcwd(), list(sys.path), os.environ.get("PYTHONPATH"))
    os.chdir(HERE)
    try:
        yield
    finally:
        os.chdir(saved[0])
        sys.path[:] = saved[1]
        if saved[2] is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved[2]


def cli(*args) -> int:
    from tplab.__main__ import main

    with in_process():
        return main(["check", *args])


T = "cli_targets:"
GOOD = {"build": T + "build", "plan": "tplab.plans:mlp", "make_input": T + "make_input"}


def args_for(build=GOOD["build"], plan=GOOD["plan"], make_input=GOOD["make_input"],
             world="2", extra=("--simulated",)):
    return (build, plan, make_input, "--world-size", world, *extra)


@pytest.mark.parametrize("args,words", [
    (args_for(build=T + "nope"), "build: 'cli_targets' has no 'nope'"),
    (args_for(build="no_such_module:build"), "build: cannot import 'no_such_module'"),
    (args_for(build="cli_targets.build"), "build: 'cli_targets.build' is not MODULE:NAME"),
    (args_for(world="500"), "--world-size 500 is more than a simulated lab runs"),
    (args_for(world="500", extra=()), "--world-size 500: world_size=500 is more than this "
                                      "machine can run"),
    (args_for(world="0"), "--world-size must be at least 1, got 0"),
    (args_for(world="two"), "argument --world-size: invalid int value: 'two'"),
    (args_for(build=T + "not_callable"), "build: cli_targets:not_callable is an int (5), not "
                                         "a function"),
    (args_for(make_input=T + "plan_list"), "make_input: cli_targets:plan_list is a list"),
    (args_for(plan=T + "plan_list"), "plan: cli_targets:plan_list is a list"),
    (args_for(plan=T + "plan_int"), "plan: cli_targets:plan_int is an int (4); a plan is a "
                                    "dict {module path: ParallelStyle}"),
    (args_for(plan=T + "plan_strings"), "plan: cli_targets:plan_strings['w1'] is a str "
                                        "('colwise'), not a ParallelStyle"),
    (args_for(plan=T + "plan_int_key"), "plan: cli_targets:plan_int_key has a key 1"),
    (args_for(plan=T + "plan_three_args"), "plan: cli_targets:plan_three_args takes 3 "
                                           "arguments"),
    (args_for(plan=T + "plan_factory_of_a_list"), "plan: cli_targets:plan_factory_of_a_list() "
                                                  "returned a list"),
    (args_for(extra=("--simulated", "--atol", "-1")), "--atol must be a finite number >= 0, "
                                                      "got -1.0"),
    (args_for(extra=("--simulated", "--atol", "nan")), "--atol must be a finite number >= 0, "
                                                       "got nan"),
    (args_for(extra=("--simulated", "--rtol", "inf")), "--rtol must be a finite number"),
    (args_for(extra=("--simulated", "--loss", T + "not_callable")), "--loss: "
                                                                    "cli_targets:not_callable"),
    (args_for(extra=("--simulated", "--train", "2", "--step", T + "step_two_args")),
     "--step: cli_targets:step_two_args takes 2 arguments; a step is a function of (model, "
     "optimizer, batch)"),
    (args_for(extra=("--simulated", "--train", "2", "--step", "train_targets:step", "--loss",
                     T + "loss")),
     "--loss cli_targets:loss with --step train_targets:step: the step computes its own "
     "loss"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_arguments_exit_2_before_anything_starts(args, words, capsys):
    import tplab

    started = []
    real_launch, real_simulate = tplab.launch, tplab.simulate
    tplab.launch = tplab.simulate = lambda *a, **k: started.append(a)  # nothing may start
    try:
        assert cli(*args) == 2
    finally:
        tplab.launch, tplab.simulate = real_launch, real_simulate
    err = capsys.readouterr().err
    assert words in err, err
    assert not started and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 or "usage:" in err  # argparse adds its usage


def test_a_missing_argument_or_command_exits_2(capsys):
    assert cli(T + "build") == 2 and "required" in capsys.readouterr().err
    from tplab.__main__ import main

    assert main(["chek"]) == 2


@pytest.mark.parametrize("args,words", [
    (args_for(extra=("--simulated", "--loss", T + "loss_int")),
     "error: --loss: loss_fn loss_int returned int 3; it must return a scalar tensor"),
    (args_for(extra=("--simulated", "--loss", T + "loss_not_scalar")),
     "error: --loss: loss_fn loss_not_scalar returned a tensor of shape (2, 4); it must "
     "return a scalar"),
    (args_for(plan=T + "colwise_twice"),
     "PlanError: layouts do not chain: w1 (ColwiseParallel) hands w2 (ColwiseParallel) a "
     "local tensor sharded on its last dim (Shard(-1))"),
    (args_for(build=T + "build_raises"), "error: build() raised RuntimeError: no weights here"),
    (args_for(plan=T + "plan_exits"), "SystemExit: 0 (on ranks 0,1)"),
], ids=["loss-int", "loss-not-scalar", "layouts", "build-raises", "sys-exit"])
def test_failures_in_user_code_are_one_line_and_exit_1(args, words, capsys):
    assert cli(*args) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert words in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line: no traceback, no torch log
    assert "Traceback" not in err + captured.out
    assert "fake_tensor" not in err + captured.out
    # and the next check runs (a simulated lab in this process)
    assert cli(*args_for(extra=("--simulated", "--loss", T + "loss"))) == 0
    assert ": ok," in capsys.readouterr().out


def test_traceback_flag_prints_the_whole_traceback(capsys):
    assert cli(*args_for(build=T + "build_raises"), "--traceback") == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "no weights here" in err
    assert err.strip().splitlines()[-1] == "error: build() raised RuntimeError: no weights here"


@pytest.mark.slow
def test_a_layout_mistake_on_rank_processes_is_one_line_before_any_rank_starts():
    bad = check(T + "build", T + "colwise_twice", T + "make_input", "--world-size", "2")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stderr.startswith("PlanError: layouts do not chain: w1 (ColwiseParallel)")
    assert len(bad.stderr.strip().splitlines()) == 1 and not bad.stdout


# --- every bad input: exit status 2 and a message that names the argument ---------------

NAMES = {"world": "--world-size", "atol": "--atol", "rtol": "--rtol", "build": "build",
         "plan": "plan", "make_input": "make_input", "loss": "--loss"}
SPECS = [T + "build", T + "not_callable", T + "nope", "cli_targets", "no_such_module:x",
         ":x", T + "plan_list"]
PLANS = ["tplab.plans:mlp", T + "plan_list", T + "plan_int", T + "plan_strings",
         T + "plan_int_key", T + "plan_three_args", T + "plan_factory_of_a_list", T + "nope"]
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["1e-5", "0", "-0.5", "abc", ""]))
WORLDS = st.one_of(st.integers(-3, 3).map(str), st.integers(65, 10**7).map(str),
                   st.sampled_from(["two", "", "2.5", "-"]))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=WORLDS, atol=NUMBERS, rtol=NUMBERS, build=st.sampled_from(SPECS),
       plan=st.sampled_from(PLANS), make_input=st.sampled_from(SPECS),
       loss=st.one_of(st.none(), st.sampled_from(SPECS)), simulated=st.booleans())
def test_every_bad_argument_exits_2_naming_it(world, atol, rtol, build, plan, make_input,
                                              loss, simulated, capsys):
    capsys.readouterr()
    bad = set()
    try:
        if not 1 <= int(world) <= 64:
            bad.add("world")
    except ValueError:
        bad.add("world")
    for flag, value in (("atol", atol), ("rtol", rtol)):
        try:
            if not 0 <= float(value) < float("inf"):
                bad.add(flag)
        except ValueError:
            bad.add(flag)
    for flag, value, good in (("build", build, T + "build"), ("plan", plan, "tplab.plans:mlp"),
                              ("make_input", make_input, T + "build"),
                              ("loss", loss, T + "build")):
        if value is not None and value != good:
            bad.add(flag)
    if not bad:  # every argument good would run a check: keep one bad
        world, bad = "0", {"world"}
    args = [build, plan, make_input, f"--world-size={world}", f"--atol={atol}",
            f"--rtol={rtol}", *(("--loss", loss) if loss else ()),
            *(("--simulated",) if simulated else ())]
    assert cli(*args) == 2
    err = capsys.readouterr().err
    assert any(NAMES[b] in err for b in bad), (bad, err)
    assert "Traceback" not in err


def test_the_pytest_fixture_shares_one_lab_across_a_users_tests(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tplab.testing"]\n')
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import functools
        from tplab import models, plans
        from tplab.testing import assert_grad_check

        CFG = models.Config(dim=16, hidden_dim=32, n_heads=4, seq_len=4, batch_size=2)
        SEEN = []

        def test_one(tplab_lab):
            SEEN.append(tplab_lab)
            assert tplab_lab.world_size == 4
            assert_grad_check(tplab_lab, functools.partial(models.MLP, CFG), plans.mlp(),
                              functools.partial(models.make_input, CFG))

        def test_two(tplab_lab):
            assert SEEN == [tplab_lab]  # the same lab, not a new one

        def test_a_failing_check_says_why(tplab_lab):
            from tplab import megatron
            broken = functools.partial(megatron.parallelize, reduce_grad=False)
            assert_grad_check(tplab_lab, functools.partial(models.MLP, CFG), broken,
                              functools.partial(models.make_input, CFG))
    """))
    got = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--tplab-simulated", "--tplab-world-size", "4", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert "1 failed, 2 passed" in got.stdout, got.stdout + got.stderr
    assert "input gradient wrong" in got.stdout
