"""`python -m tplab check` exit codes (0 ok, 1 failed, 2 bad arguments) and the
`tplab.testing` pytest fixture, each run as a user's CI would: in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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
def test_check_on_rank_processes_imports_the_targets_there_too():
    bad = check("cli_targets:build", "cli_targets:broken", "cli_targets:make_input",
                "--world-size", "2")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED: input gradient wrong" in bad.stdout


@pytest.mark.parametrize("args,words", [
    (("cli_targets:nope", "tplab.plans:mlp", "cli_targets:make_input"),
     "'cli_targets' has no 'nope'"),
    (("no_such_module:build", "tplab.plans:mlp", "cli_targets:make_input"),
     "cannot import 'no_such_module'"),
    (("cli_targets.build", "tplab.plans:mlp", "cli_targets:make_input"),
     "is not MODULE:NAME")])
def test_bad_arguments_exit_2_and_say_what_is_wrong(args, words, capsys, monkeypatch):
    from tplab.__main__ import main

    monkeypatch.chdir(HERE)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # main() sets it
    monkeypatch.setattr(sys, "path", list(sys.path))  # and puts the cwd on the path
    assert main(["check", *args, "--world-size", "2", "--simulated"]) == 2
    assert words in capsys.readouterr().err
    with pytest.raises(SystemExit) as missing:  # argparse: a missing argument
        main(["check", "cli_targets:build"])
    assert missing.value.code == 2 and "required" in capsys.readouterr().err
    assert main(["chek"]) == 2


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
