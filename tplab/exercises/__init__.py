"""Exercises with feedback on real ranks: write f, g, parallel linears, plans; predict counts
and costs. Each answer runs on the lab's ranks (or a `tplab.simulate`) against a reference.

    from tplab import exercises
    exercises.names()                       # what there is
    exercises.task("f")                     # what to write
    fb = exercises.check("f", MyF, lab)     # Feedback: .passed, .message; a box in Jupyter
    exercises.hint("f", 2)                  # graded hints, 1 to 3
    exercises.solution("f")                 # the reference, as source

A failed check names what is wrong, where, and on which rank; an answer that raises or
hangs gets feedback too (with a short timeout), and the lab stays usable. Workbooks in
notebooks/exercises/ use `Workbook`, which injects solutions or typical mistakes for CI.
"""

from __future__ import annotations

import inspect
import re

# Only rank-side modules at import time: the ranks import this package to reach `steps`,
# `solutions` and `mistakes`, and must not import the notebook side (catalog, checks,
# feedback, IPython); those load on first use.
from tplab.exercises import mistakes
from tplab.exercises.solutions import SOLUTIONS

_NOTEBOOK_SIDE = {"Feedback": "tplab.exercises.feedback",
                  "CHECK_TIMEOUT_S": "tplab.exercises.feedback",
                  "EXERCISES": "tplab.exercises.catalog"}


def __getattr__(name: str):
    if name in _NOTEBOOK_SIDE:
        import importlib

        return getattr(importlib.import_module(_NOTEBOOK_SIDE[name]), name)
    raise AttributeError(f"module 'tplab.exercises' has no attribute {name!r}")

__all__ = ["CHECK_TIMEOUT_S", "Feedback", "Workbook", "broken_plan", "check", "hint", "names",
           "reference_answer", "solution", "task"]


def names() -> list[str]:
    """The exercises, in curriculum order."""
    from tplab.exercises.catalog import EXERCISES

    return [e.name for e in EXERCISES]


def _get(name: str):
    from tplab.exercises.catalog import BY_NAME

    if name not in BY_NAME:
        import difflib

        close = difflib.get_close_matches(str(name), BY_NAME, n=1)
        raise KeyError(f"no exercise named {name!r}"
                       + (f"; did you mean {close[0]!r}?" if close else "")
                       + f" Exercises: {', '.join(names())}")
    return BY_NAME[name]


class Text(str):
    """A string that Jupyter shows as Markdown."""

    def _repr_markdown_(self) -> str:
        return str(self)


# Code inside prose: a class statement, a call such as forward(x) or mesh.get_group(), or a
# dunder name; Markdown would otherwise make __init__ bold and drop its underscores.
_CODE = re.compile(r"class \w+\([^()]*\)|[A-Za-z_][\w.]*\([^()]*\)|__\w+__")


def as_markdown(text: str) -> str:
    """Prose with its code in backticks (parts already in backticks are left alone)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside backticks
        parts[i] = _CODE.sub(lambda m: f"`{m.group(0)}`", parts[i])
    return "`".join(parts)


def task(name: str) -> Text:
    """What exercise `name` asks for."""
    e = _get(name)
    return Text(f"**{e.title}** (`{e.name}`, notebook {e.notebook})\n\n{as_markdown(e.task)}")


def hint(name: str, level: int = 1) -> Text:
    """Hint `level` (1: a nudge, 2: the idea, 3: nearly the code) for exercise `name`."""
    e = _get(name)
    if not isinstance(level, int) or level < 1:
        raise ValueError(f"hint level is 1, 2 or {len(e.hints)}; got {level!r}")
    text = e.hints[min(level, len(e.hints)) - 1]
    more = "" if level >= len(e.hints) else f" (more: exercises.hint({name!r}, {level + 1}))"
    return Text(f"Hint {min(level, len(e.hints))} of {len(e.hints)} for `{name}`: "
                f"{as_markdown(text)}{more}")


class Solution(Text):
    """The reference solution: its source as Markdown, the object itself as `.answer`."""

    answer: object = None


def solution(name: str) -> Solution:
    """The reference solution of exercise `name` (tplab/exercises/solutions.py)."""
    _get(name)
    answer = SOLUTIONS[name]
    parts = answer if isinstance(answer, tuple) else (answer,)
    try:
        src = "\n\n".join(inspect.getsource(p) for p in parts)
    except TypeError:  # a dict plan: its items
        src = "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in answer.items()) + "}"
    out = Solution(f"```python\n{src.rstrip()}\n```")
    out.answer = answer
    return out


def broken_plan() -> dict:
    """The plan exercise "fix_plan" asks you to fix."""
    return dict(mistakes.BROKEN_PLAN)


def check(name: str, answer, lab=None):
    """Run `answer` for exercise `name` on `lab` (a Lab or a Simulation) and compare it with
    the reference. Never raises for a wrong answer: the Feedback says what is wrong."""
    from tplab.exercises.feedback import Feedback, Stop

    e = _get(name)
    if e.needs_lab and lab is None:
        raise ValueError(f"exercise {name!r} runs on ranks: check({name!r}, answer, lab)")
    if e.needs_lab and not hasattr(lab, "run"):
        raise TypeError(f"lab must be a tplab.launch(...) or tplab.simulate(...), not {lab!r}")
    try:
        return Feedback(name, True, e.checker(name, answer, lab))
    except Stop as stop:
        return stop.feedback


def reference_answer(name: str, lab=None):
    """The reference solution as an answer to `check` on `lab` (for "block_counts" the
    counts at the lab's world size)."""
    _get(name)
    answer = SOLUTIONS[name]
    if name == "block_counts":
        return answer(lab.world_size)
    if name in ("cost_prediction", "block_memory"):
        return answer()
    return answer


class Workbook:
    """What a workbook's cells call. `inject`: "" checks the learner's answers; "solutions"
    checks the reference solutions instead (each must pass); "mistakes" checks the first
    typical mistake of each exercise (each must fail, with its message). `check` returns
    the Feedback: the last line of a cell, it shows as a box."""

    def __init__(self, lab, inject: str = ""):
        if inject not in ("", "solutions", "mistakes"):
            raise ValueError(f'inject is "", "solutions" or "mistakes", not {inject!r}')
        self.lab, self.inject = lab, inject
        self.results: dict = {}

    def check(self, name: str, answer=None):
        expect = None
        if self.inject == "solutions":
            answer = reference_answer(name, self.lab)
        elif self.inject == "mistakes":
            _, answer, expect = mistakes.MISTAKES[name][0]
        fb = check(name, answer, self.lab)
        self.results[name] = fb
        if self.inject == "solutions":
            assert fb.passed, f"the reference solution of {name!r} failed: {fb.message}"
        elif self.inject == "mistakes":
            assert not fb.passed, f"a typical mistake passed {name!r}"
            assert expect in fb.message, f"{name!r}: {expect!r} not in {fb.message!r}"
        return fb

    def summary(self):
        from IPython.display import Markdown

        rows = "".join(f"| `{n}` | {'passed' if fb.passed else 'not yet'} |\n"
                       for n, fb in self.results.items())
        return Markdown("| exercise | result |\n|---|---|\n" + rows)
