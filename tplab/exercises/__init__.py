"""Exercises with feedback on real ranks: write f, g, parallel linears, plans; predict counts
and costs. Each answer runs on the lab's ranks (or a `tplab.simulate`) against a reference.

    from tplab import exercises
    exercises.names()                       # what there is
    exercises.task("f")                     # what to write
    fb = exercises.check("f", MyF, lab)     # Feedback: .passed, .message; a box in Jupyter
    exercises.hint("f", 2)                  # graded hints, 1 to 3
    exercises.solution("f")                 # the reference, as source

A failed check names what is wrong, where, and on which rank; an answer that raises, hangs
in a collective (CHECK_TIMEOUT_S) or computes forever (CHECK_TIME_LIMIT_S, `time_limit=`)
gets feedback too, and the lab stays usable. A lab of one rank cannot tell a right answer
from a wrong one: `check` refuses it (LabError). Workbooks in
notebooks/exercises/ use `Workbook`, which injects solutions or typical mistakes for CI.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import re

from IPython.display import Markdown

from tplab.core.answers import mistakes, solutions
from tplab.errors import CellTimeout, LabError
from tplab.exercises import predictions
from tplab.exercises.catalog import BY_NAME, EXERCISES
from tplab.exercises.feedback import (
    CHECK_TIME_LIMIT_S,
    CHECK_TIMEOUT_S,
    Feedback,
    Stop,
    time_bounded,
    too_long,
)
from tplab.lab.arguments import check_timeout
from tplab.lab.contract import Ranks
from tplab.lab.time_limit import TimeLimitReached

# every exercise's reference solution, and its typical mistakes: those the ranks run
# (tplab/core/answers/) and those the notebook judges alone (predictions.py)
SOLUTIONS = {**solutions.SOLUTIONS, **predictions.SOLUTIONS}
MISTAKES = {**mistakes.MISTAKES, **predictions.MISTAKES}

__all__ = ["CHECK_TIMEOUT_S", "CHECK_TIME_LIMIT_S", "MISTAKES", "SOLUTIONS", "Feedback",
           "Workbook", "broken_plan",
           "check", "hint", "names", "reference_answer", "solution", "task"]


def names() -> list[str]:
    """The exercises, in curriculum order."""
    return [e.name for e in EXERCISES]


def _get(name: str):
    if name not in BY_NAME:
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
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"hint level is a number, 1 to {len(e.hints)}: "
                        f"exercises.hint({name!r}, 1); got {type(level).__name__} {level!r}")
    if level < 1:
        raise ValueError(f"hint level is 1, 2 or {len(e.hints)}; got {level!r}")
    text = e.hints[min(level, len(e.hints)) - 1]
    more = "" if level >= len(e.hints) else f" (more: exercises.hint({name!r}, {level + 1}))"
    return Text(f"Hint {min(level, len(e.hints))} of {len(e.hints)} for `{name}`: "
                f"{as_markdown(text)}{more}")


class Solution(Text):
    """The reference solution: its source as Markdown, the object itself as `.answer`."""

    answer: object = None


def solution(name: str) -> Solution:
    """The reference solution of exercise `name` (tplab/core/answers/solutions.py, or
    predictions.py beside this file)."""
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


def check(name: str, answer, lab=None, time_limit: float | None = None):
    """Run `answer` for exercise `name` on `lab` (a Lab or a Simulation) and compare it with
    the reference. Never raises for a wrong or malformed answer: the Feedback says what is
    wrong. An answer that waits in a collective gets CHECK_TIMEOUT_S; one that computes
    gets `time_limit` seconds (default CHECK_TIME_LIMIT_S), then is stopped: rank
    processes are interrupted; in a Simulation the answer's own Python code is stopped
    between bytecodes (a single long torch op finishes first; tplab/lab/time_limit.py).

    Raises (these are about the call, not the answer): KeyError for an unknown exercise,
    ValueError/TypeError for a missing or wrong `lab` or `time_limit`, LabError for a lab
    that was shut down or that has too few ranks to tell a right answer from a wrong one.
    """
    e = _get(name)
    limit = check_timeout(time_limit, "time_limit") or CHECK_TIME_LIMIT_S
    if e.needs_lab and lab is None:
        raise ValueError(f"exercise {name!r} runs on ranks: check({name!r}, answer, lab)")
    if e.needs_lab and not isinstance(lab, Ranks):
        raise TypeError(f"lab must be a tplab.launch(...) or tplab.simulate(...), not {lab!r}")
    if e.needs_lab and lab.closed:
        raise LabError(f"the lab was shut down, so exercise {name!r} cannot run: start a new "
                       "one with tplab.launch(2) (or tplab.simulate(2)) and check again")
    if e.needs_lab and lab.world_size < e.min_world_size:
        raise LabError(
            f"exercise {name!r} needs a lab of at least {e.min_world_size} ranks: on "
            f"{lab.world_size} rank{'s' if lab.world_size != 1 else ''} there is nothing to "
            "split and no collective moves data, so a wrong answer computes the same as a "
            f"right one. Check it on tplab.launch({e.min_world_size}) or "
            f"tplab.simulate({e.min_world_size})")
    watch = None
    try:
        with (time_bounded(lab, limit) if e.needs_lab else contextlib.nullcontext()) as watch:
            return Feedback(name, True, e.checker(name, answer, lab))
    except (CellTimeout, TimeLimitReached) as err:
        return too_long(name, limit, lab, err).feedback
    except Stop as stop:
        if watch is not None and watch.reached:  # stopped, and reported as an exception
            return too_long(name, limit, lab).feedback
        return stop.feedback
    except Exception as exc:  # noqa: BLE001 - an answer no checker foresaw: say so, do not raise
        if watch is not None and watch.reached:
            return too_long(name, limit, lab).feedback
        return Feedback(name, False, f"this answer could not be checked: {type(exc).__name__}: "
                        f"{exc}. The answer was {_short(answer)}; exercises.task({name!r}) "
                        "says what it should be")


def _short(value) -> str:
    try:
        text = f"{type(value).__name__} {value!r}"
    except Exception:  # noqa: BLE001 - a repr that raises
        text = f"a {type(value).__name__}"
    return text if len(text) <= 120 else text[:117] + "..."


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
            _, answer, expect = MISTAKES[name][0]
        fb = check(name, answer, self.lab)
        self.results[name] = fb
        if self.inject == "solutions":
            assert fb.passed, f"the reference solution of {name!r} failed: {fb.message}"
        elif self.inject == "mistakes":
            assert not fb.passed, f"a typical mistake passed {name!r}"
            assert expect in fb.message, f"{name!r}: {expect!r} not in {fb.message!r}"
        return fb

    def summary(self):
        rows = "".join(f"| `{n}` | {'passed' if fb.passed else 'not yet'} |\n"
                       for n, fb in self.results.items())
        return Markdown("| exercise | result |\n|---|---|\n" + rows)
