"""tplab.exercises: every reference solution passes and every typical mistake fails with
feedback that names it, on real ranks and in a simulation; the lab stays usable after."""

from __future__ import annotations

import pytest

import tplab
from tplab import exercises, models
from tplab.core.answers import clipping, mistakes, solutions
from tplab.training import lm
from tplab.training.steps import lm_step, sgd


def test_catalog():
    names = exercises.names()
    assert len(names) >= 10 and len(set(names)) == len(names)
    assert set(names) == set(exercises.SOLUTIONS) == set(exercises.MISTAKES)
    for name in names:
        assert "Hint 1 of 3" in exercises.hint(name, 1)
        assert exercises.hint(name, 9).startswith("Hint 3 of 3")
        assert exercises.solution(name).startswith("```python")
        assert exercises.task(name)
    assert "class F_" in exercises.solution("f") and "all_reduce" in exercises.solution("f")


def test_bad_calls_say_what_is_wrong():
    with pytest.raises(KeyError, match="did you mean 'row_parallel'"):
        exercises.check("row_paralel", None, None)
    with pytest.raises(ValueError, match="runs on ranks"):
        exercises.check("f", solutions.F_)
    with pytest.raises(ValueError, match="hint level"):
        exercises.hint("f", 0)
    with pytest.raises(ValueError, match="inject"):
        exercises.Workbook(None, inject="everything")


def test_feedback_display():
    fb = exercises.check("cost_prediction", {"bytes": 1, "seconds": 1})
    assert not fb and "bytes" in fb.message
    assert 'data-passed="false"' in fb._repr_html_()
    fb = exercises.check("cost_prediction", solutions.cost_prediction())
    assert fb.passed and 'data-passed="true"' in fb._repr_html_()


def test_answers_of_the_wrong_kind(labs):
    lab = labs.get(2)
    fb = exercises.check("f", lambda x, group: x, lab)
    assert not fb.passed and "torch.autograd.Function subclass" in fb.message
    fb = exercises.check("mlp_plan", ["w1"], lab)
    assert not fb.passed and "a plan is a dict" in fb.message


@pytest.mark.slow
def test_on_real_ranks(labs):
    lab = labs.get(2)
    for name in exercises.names():
        fb = exercises.check(name, exercises.reference_answer(name, lab), lab)
        assert fb.passed, (name, fb.message)
        for what, answer, phrase in exercises.MISTAKES[name]:
            fb = exercises.check(name, answer, lab)
            assert not fb.passed, (name, what)
            assert phrase in fb.message, (name, what, fb.message)
            if "rank 0 only" in what:  # the hang is reported, and the lab works after it
                assert "rank 0 is in all_reduce" in fb.message
                assert exercises.check(name, solutions.F_, lab).passed


def test_messages_name_ranks_and_sizes(labs):
    lab = labs.get(2)
    fb = exercises.check("f", mistakes.FNoReduce, lab)
    assert fb.message.startswith("your backward returns each rank's own term: dL/dx differs "
                                 "across ranks by up to ")
    fb = exercises.check("column_parallel", mistakes.ColumnGathered, lab)
    assert "on rank 0 your output has shape (2, 3, 8)" in fb.message
    fb = exercises.check("f", mistakes.FRaises, lab)
    assert "on ranks 0,1: NameError: name 'y' is not defined" in fb.message


# world 2 as on real ranks above; 4 in the extended run (twice the time of 2 here)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_in_a_simulation(world_size):
    sim = tplab.simulate(world_size)
    for name in exercises.names():
        fb = exercises.check(name, exercises.reference_answer(name, sim), sim)
        assert fb.passed, (name, fb.message)
        for what, answer, phrase in exercises.MISTAKES[name]:
            if "rank 0 only" in what:  # one process runs every rank: nothing can hang
                continue
            fb = exercises.check(name, answer, sim)
            assert not fb.passed and phrase in fb.message, (name, what, fb.message)


def test_rank_side_imports_no_notebook_side():
    import subprocess
    import sys

    # what a rank loads to run an exercise: its step and the answers (tplab/core/answers/)
    code = ("import sys, tplab.rank.exercise_steps, tplab.core.answers.mistakes; print([m for m "
            "in sys.modules if m.startswith(('IPython', 'ipywidgets', 'plotly', 'tplab.lab', "
            "'tplab.exercises', 'tplab.cost', 'tplab.checks', 'tplab.viz'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_instructions_render_as_markdown():
    """The class signature is code, and __init__ is not turned bold by Markdown: outside
    backticks no dunder and no call is left, in the tasks and in the workbooks' cells."""
    import json
    import pathlib
    import re

    text = str(exercises.task("column_parallel"))
    assert "`class Answer(nn.Module)`: `__init__(self, linear, mesh)`" in text, text
    prose = re.compile(r"__\w+__|\b\w+\([^()]*\)")
    for name in exercises.names():
        outside = str(exercises.task(name)).split("`")[::2]
        assert not any(prose.search(part) for part in outside), (name, outside)
    books = pathlib.Path(__file__).parent.parent / "notebooks" / "exercises"
    for path in sorted(books.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown" and source.startswith("## "):
                assert "**" not in source.splitlines()[0], (path.name, source)
                outside = source.split("`")[::2]
                assert not any(prose.search(p) for p in outside), (path.name, source)


def _endless_clip(model, max_norm):
    while True:
        pass


def test_clip_grad_is_judged_against_torchs_own_clipping():
    """A no-op, a halving, max_norm ignored, no norm returned: done alike on one device and
    on the ranks they would pass a check that runs the answer on both; the reference is
    torch's clip_grad_norm_ on the whole model, and the clipping it judges is real.

    clip_tp passing and the four mistakes failing (with their phrases) on tplab.simulate(2)
    are judged by test_in_a_simulation[2] (the reference answer and every MISTAKES entry);
    checked here is that they are the ones it judges, and the one answer it does not run."""
    assert exercises.SOLUTIONS["clip_grad"] is clipping.clip_tp
    judged = [answer for _, answer, _ in exercises.MISTAKES["clip_grad"]]
    for answer in (clipping.no_clip, clipping.halve, clipping.ignore_max_norm,
                   clipping.returns_none):
        assert answer in judged, answer
    fb = exercises.check("clip_grad", lambda model, max_norm: None, tplab.simulate(2))
    assert not fb.passed, fb.message
    # the truth clips: at the check's max_norm=0.05 the whole model's norm is far above it
    cfg = models.Config(vocab_size=16, dim=8, n_layers=1, n_heads=2, hidden_dim=16,
                        seq_len=4, batch_size=2)
    model = models.TinyLM(cfg)
    norms = []
    lm_step(model, sgd(model.parameters()), lm.counting_batches(cfg)(0), max_norm=0.05,
            clip=lambda m, n: norms.append(clipping.judged(m, n, answer=None)))
    assert not clipping.is_split(model) and norms[0] > 1.0


def test_an_endless_clip_answer_is_stopped_in_a_simulation():
    fb = exercises.check("clip_grad", _endless_clip, tplab.simulate(2), time_limit=2)
    assert not fb.passed and "still computing after 2 s" in fb.message, fb.message


@pytest.mark.slow
@pytest.mark.timeout(180)  # before the fix the one-device reference ran it unbounded
def test_an_endless_clip_answer_is_stopped_on_rank_processes(labs):
    lab = labs.get(2)
    fb = exercises.check("clip_grad", _endless_clip, lab, time_limit=5)
    assert not fb.passed and "still computing after 5 s" in fb.message, fb.message
    assert exercises.check("clip_grad", exercises.reference_answer("clip_grad", lab),
                           lab).passed


class _CountingLab:
    """Stands for a lab: answers plan_counts with how often it was asked."""

    world_size = 2

    def __init__(self):
        self.calls = 0

    def run(self, fn, *args, timeout=None):
        self.calls += 1
        return [{"counts": {"traced": self.calls}}]


def test_reference_counts_are_traced_once_per_lab_and_key():
    """A reference plan's collectives are traced at the first check on a lab and reused for
    the same key there; another key, or another lab, traces its own."""
    import gc
    import weakref

    from tplab.exercises import checks

    lab, other = _CountingLab(), _CountingLab()
    first = checks.reference_counts("mlp_plan", lab, None, None, None, "the MLP")
    assert checks.reference_counts("mlp_plan", lab, None, None, None, "the MLP") is first
    assert lab.calls == 1
    block = checks.reference_counts("block_sp_plan", lab, None, None, None, "the block")
    assert lab.calls == 2 and block is not first
    checks.reference_counts("mlp_plan", other, None, None, None, "the MLP")
    assert other.calls == 1 and lab.calls == 2
    gone = weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None  # the cache does not keep a lab alive
