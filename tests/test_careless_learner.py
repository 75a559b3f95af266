"""What a careless learner does to the exercises, sys.exit and the magics (issue 22): each
case gets a clear error or feedback that names the problem, and the lab (or simulation)
still runs an all-reduce afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import tplab
from tplab import exercises
from tplab.core.answers import solutions


def all_reduce_of_ranks():
    """Rank side: the sum of (rank + 1) over the ranks."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(()) + (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t


def assert_all_reduces(lab):
    n = lab.world_size
    got = [float(v) for v in lab.run(all_reduce_of_ranks)]
    assert got == [n * (n + 1) / 2] * n


class FExits(torch.autograd.Function):
    """An answer that ends the process it runs in."""

    @staticmethod
    def forward(ctx, x, group):
        sys.exit(0)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FForever(torch.autograd.Function):
    """An answer whose forward never ends, catching everything it can on the way."""

    @staticmethod
    def forward(ctx, x, group):
        while True:
            try:
                pass
            except Exception:
                pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def plan_forever(model, mesh):
    """A plan function (model, mesh) -> model that never returns."""
    while True:
        pass


class FUnsendable(solutions.F_):
    """A right f that holds a lock: it cannot be copied to a rank process."""

    lock = threading.Lock()


class FTypo(torch.autograd.Function):
    """A typo in the forward."""

    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(y)  # noqa: F821 - the typo

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FNoSource(torch.autograd.Function):
    """Raises from code whose source file is gone (as a cell's can be on a rank)."""

    forward = staticmethod(eval(compile("lambda ctx, x, group: 1 / 0", "/gone/cell.py", "eval")))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --- item 3: a 1-rank lab cannot tell right from wrong ---------------------------------------

def test_one_rank_labs_refuse_lab_exercises_and_name_the_world_size(labs):
    with tplab.simulate(1) as one:
        for name in exercises.names():
            from tplab.exercises.catalog import BY_NAME

            if not BY_NAME[name].needs_lab:
                continue
            with pytest.raises(tplab.LabError, match=r"at least 2 ranks.*tplab.launch\(2\)"):
                exercises.check(name, exercises.reference_answer(name, one), one)
    one = labs.get(1)   # shared with other tests (a world-1 lab of processes)
    with pytest.raises(tplab.LabError, match="at least 2 ranks"):
        exercises.check("f", lambda x, group: x, one)
    assert_all_reduces(one)
    # the exercises without a lab still check at any size, and a 2-rank lab still judges
    assert exercises.check("cost_prediction", solutions.cost_prediction()).passed
    sim = tplab.simulate(2)
    assert not exercises.check("f", solutions.G, sim).passed
    assert_all_reduces(sim)


# --- item 4: sys.exit on a simulated rank is a RankError ------------------------------------

def test_sys_exit_in_a_simulation_is_a_rank_error(tmp_path):
    sim = tplab.simulate(2)
    with pytest.raises(tplab.RankError, match="SystemExit: 3"):
        sim.run(lambda: sys.exit(3))
    with pytest.raises(tplab.RankError, match="SystemExit"):
        sim.execute("import sys\nsys.exit(0)")
    fb = exercises.check("f", FExits, sim)
    assert not fb.passed and "SystemExit" in fb.message, fb.message
    assert_all_reduces(sim)
    (tmp_path / "exits.py").write_text(textwrap.dedent("""
        import functools, sys
        from tplab import models
        CFG = models.Config(dim=16, hidden_dim=32, n_heads=2, seq_len=4, batch_size=2)
        build = functools.partial(models.MLP, CFG)
        make_input = functools.partial(models.make_input, CFG)
        def plan(model, mesh):
            sys.exit(0)
    """))
    out = subprocess.run([sys.executable, "-m", "tplab", "check", "exits:build", "exits:plan",
                          "exits:make_input", "--world-size", "2", "--simulated"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [os.path.dirname(os.path.dirname(tplab.__file__)),
                              os.environ.get("PYTHONPATH", "")])})
    assert out.returncode != 0, out.stdout + out.stderr
    assert "SystemExit" in out.stdout + out.stderr


# --- item 5: an answer that computes forever gets bounded time ------------------------------

def test_an_answer_that_computes_forever_is_stopped_in_a_simulation():
    sim = tplab.simulate(2)
    fb = exercises.check("f", FForever, sim, time_limit=1.0)
    assert not fb.passed
    assert "still computing after 1 s" in fb.message and "stopped" in fb.message
    assert sys.gettrace() is None or "time_limit" not in repr(sys.gettrace())
    fb = exercises.check("mlp_plan", plan_forever, sim, time_limit=1.0)   # in grad_check
    assert not fb.passed and "still computing after 1 s" in fb.message, fb.message
    assert exercises.check("f", solutions.F_, sim).passed
    assert_all_reduces(sim)


@pytest.mark.slow
def test_an_answer_that_computes_forever_is_interrupted_on_ranks(labs):
    lab = labs.get(2)
    fb = exercises.check("f", FForever, lab, time_limit=3.0)
    assert not fb.passed and "still computing after 3 s" in fb.message, fb.message
    assert "ranks were interrupted" in fb.message
    fb = exercises.check("mlp_plan", plan_forever, lab, time_limit=3.0)   # in grad_check
    assert not fb.passed and "still computing after 3 s" in fb.message, fb.message
    assert lab.cell_timeout is None                                      # as it was
    assert exercises.check("f", solutions.F_, lab).passed
    assert_all_reduces(lab)


# --- item 6: malformed answers get feedback, bad calls a clear error ------------------------

@pytest.mark.parametrize("name,answer,words", [
    ("cost_prediction", {"bytes": "abc", "seconds": 1e-4}, '"bytes" must be a number'),
    ("cost_prediction", {"bytes": float("nan"), "seconds": 1e-4}, "finite number"),
    ("cost_prediction", None, "the answer is a dict"),
    ("cost_prediction", {"bytes": "abc"}, "(it lacks 'seconds')"),
    ("block_memory", None, "the answer is a dict"),
    ("block_memory", {"activation_bytes": None}, '"activation_bytes" must be a number'),
    ("block_counts", {"forward": 2}, '"forward" must be a dict {op: count}'),
    ("block_counts", {"forward": {"all_reduce": "two"}}, "must be a whole number"),
    ("block_counts", [], "the answer is a dict"),
    ("f", None, "torch.autograd.Function subclass"),
    ("sp_pair", (None, None), "torch.autograd.Function subclass"),
    ("mlp_plan", 3, "a plan is a dict"),
])
def test_malformed_answers_get_feedback_not_an_exception(name, answer, words):
    sim = tplab.simulate(2)
    fb = exercises.check(name, answer, sim)
    assert not fb.passed and words in fb.message, fb.message
    assert_all_reduces(sim)


def test_feedback_for_an_exception_shows_the_learner_s_line(labs):
    lab = labs.get(2)
    for where in (tplab.simulate(2), lab):
        fb = exercises.check("f", FTypo, where)
        assert "NameError: name 'y' is not defined at " in fb.message, fb.message
        assert fb.message.endswith(": return x.view_as(y)  # noqa: F821 - the typo"), fb.message
    assert_all_reduces(lab)
    sim = tplab.simulate(2)
    fb = exercises.check("f", FNoSource, sim)   # no source: the place, not the error twice
    assert fb.message.endswith("ZeroDivisionError: division by zero at /gone/cell.py, line 1")
    assert_all_reduces(sim)


def test_bad_calls_are_errors_that_name_the_argument(labs):
    with pytest.raises(TypeError, match="hint level is a number"):
        exercises.hint("f", True)
    with pytest.raises(TypeError, match="hint level is a number"):
        exercises.hint("f", "2")
    with pytest.raises(ValueError, match="time_limit"):
        exercises.check("f", solutions.F_, tplab.simulate(2), time_limit=-1)
    lab = tplab.launch(2)
    lab.shutdown()
    with pytest.raises(tplab.LabError, match="shut down"):
        exercises.check("f", solutions.F_, lab)
    lab = labs.get(2)
    fb = exercises.check("f", FUnsendable, lab)
    assert not fb.passed, fb.message
    assert fb.message.startswith("your answer cannot be sent to the ranks")
    assert "conjugate_step" not in fb.message and "lock" in fb.message
    assert_all_reduces(lab)


# --- item 10: display on a rank, and a trailing semicolon -----------------------------------

def test_display_on_a_rank_shows_in_the_notebook_and_a_semicolon_hides_the_value(labs):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output
    from traitlets.config import Config

    from tplab.lab.magics import register_magics

    lab = labs.get(2)
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    register_magics(lab)

    def cell(code):
        with capture_output() as cap:
            result = shell.run_cell(code)
        assert result.success, result.error_in_exec
        return cap

    cap = cell("%%ranks\nfrom IPython.display import HTML, display\n"
               "display(HTML('<b>on a rank</b>'))\ndisplay(rank)\n40 + 2")
    html = [o.data for o in cap.outputs if "text/html" in o.data]
    assert [d["text/html"] for d in html] == ["<b>on a rank</b>"]   # the same: shown once
    assert sorted(o.data["text/plain"] for o in cap.outputs if "text/html" not in o.data) == [
        "0", "1"]                                                    # rank by rank
    assert "[ranks 0,1] display:" in cap.stdout and "[rank 1] display:" in cap.stdout
    assert "[ranks 0,1] 42" in cap.stdout
    cap = cell("%%ranks\n40 + 2;")
    assert "42" not in cap.stdout and not cap.outputs
    cap = cell("%%rank 1\nimport threading\nthreading.Lock()  ;  # a value that cannot travel")
    assert "Lock" not in cap.stdout and "cannot be sent" not in cap.stdout
    cap = cell("%%ranks\n41 + 1  # no semicolon")
    assert "[ranks 0,1] 42" in cap.stdout

    def shows():
        from IPython.display import Markdown, display

        display(Markdown("**from lab.run**"))
        return 1

    with capture_output() as cap:
        assert lab.run(shows) == [1, 1]
    assert [o.data["text/markdown"] for o in cap.outputs] == ["**from lab.run**"]
    assert_all_reduces(lab)
