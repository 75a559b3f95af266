"""What a check says: `Feedback(passed, message)`, shown as a coloured box in Jupyter.

Also the translation of what can go wrong while an answer runs on the ranks (an exception,
a collective some ranks never reach, a plan that does not fit) into feedback that says what
went wrong, where and on which rank, while the lab stays usable.
"""

from __future__ import annotations

import html
import inspect
import linecache
import re
from dataclasses import dataclass

import torch

from tplab.errors import (
    CellTimeout,
    CollectiveHang,
    LabError,
    PlanError,
    RankDied,
    RankError,
    format_rank_list,
)
from tplab.lab.contract import Ranks

CHECK_TIMEOUT_S = 10.0  # an answer that waits longer than this in a collective is stuck
CHECK_TIME_LIMIT_S = 60.0  # an answer computing longer never ends (a busy room: imports)


class Stop(Exception):
    """Raised inside a check with the feedback that ends it."""

    def __init__(self, feedback: Feedback):
        self.feedback = feedback
        super().__init__(feedback.message)


@dataclass(frozen=True)
class Feedback:
    """The verdict on one answer: `passed`, and a `message` that names what is wrong, where
    and on which rank (or what was checked, when it passed)."""

    name: str
    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return f"{'PASSED' if self.passed else 'NOT YET'} [{self.name}] {self.message}"

    def _repr_html_(self) -> str:
        color, mark = ("#1b7e3c", "&#10004; passed") if self.passed else ("#b3261e",
                                                                          "&#10008; not yet")
        body = html.escape(self.message).replace("\n", "<br>")
        return (f'<div class="tplab-feedback" data-passed="{str(self.passed).lower()}" '
                f'style="border-left:4px solid {color};padding:4px 10px;margin:4px 0">'
                f'<b style="color:{color}">{mark}</b> <code>{html.escape(self.name)}</code>'
                f'<br>{body}</div>')


def fail(name: str, message: str) -> Stop:
    return Stop(Feedback(name, False, message))


def _last_line(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "an exception"


_FRAME = re.compile(r'^(\s*)File "([^"]+)", line (\d+)')


def frames(tb: str) -> list[tuple[str, str, str]]:
    """(file, line, source line or "") of each frame of a formatted traceback. A frame's
    source line is the next line when it is indented deeper than its `File` line (and is
    not a `^^^` marker); a frame whose source is not known has none, and the line after it
    is the next frame or the exception itself."""
    lines = tb.splitlines()
    found = []
    for i, text in enumerate(lines):
        m = _FRAME.match(text)
        if not m:
            continue
        code = lines[i + 1] if i + 1 < len(lines) else ""
        deeper = len(code) - len(code.lstrip()) > len(m.group(1))
        if not deeper or _FRAME.match(code) or not code.strip().strip("^~ "):
            code = ""
        found.append((m.group(2), m.group(3), code.strip()))
    return found


def answer_sources(args) -> list[tuple[str, int, int]]:
    """(file, first line, last line) of the classes and functions among `args` (the
    answer, sent to the ranks by value), where this process knows their source."""
    found = []
    for obj in args:
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        try:
            lines, start = inspect.getsourcelines(obj)
            found.append((inspect.getsourcefile(obj) or "", start, start + len(lines) - 1))
        except (OSError, TypeError):
            continue
    return found


def _source_line(line: int, sources) -> str:
    """The answer's source line `line`, when exactly one of the answer's sources holds it
    (a rank knows code sent by value only by its line numbers)."""
    hits = {linecache.getline(f, line).strip() for f, a, b in sources if a <= line <= b}
    hits.discard("")
    return hits.pop() if len(hits) == 1 else ""


def _user_line(tb: str, sources=()) -> str:
    """The innermost frame of the traceback outside torch and tplab: the learner's line.
    A frame without its source (code that travelled by value) gets the line from the
    answer's own source in this process, when it has one."""
    own = [f for f in frames(tb) if "site-packages" not in f[0] and "/tplab/" not in f[0]]
    if not own:
        return ""
    path, line, code = own[-1]
    if not code and path.startswith("<"):
        code = _source_line(int(line), sources)
    where = "your cell" if path.startswith("<") or "ipykernel" in path else path
    return f" at {where}, line {line}: {code}" if code else f" at {where}, line {line}"


def time_bounded(lab: Ranks, limit: float):
    """Bound how long an answer may compute during one check (grad_check included): the
    lab's `time_limit` (rank processes get `cell_timeout=limit` on every call, the watchdog
    interrupts them and the lab stays usable; a Simulation runs in this process, where the
    learner's own Python code is stopped between bytecodes instead). Yields the limit (its
    `.reached` says it stopped the answer)."""
    return lab.time_limit(limit)


def too_long(name: str, limit: float, lab: Ranks, err=None) -> Stop:
    """The feedback for an answer stopped by its time limit."""
    where = ""
    if isinstance(err, CellTimeout):
        where = f"\n{str(err).split(chr(10), 1)[-1]}"
    kind = ("its Python code was stopped (the simulation runs in this process)"
            if lab.in_process else "the ranks were interrupted")
    return fail(name, f"your answer was still computing after {limit:g} s, so it was stopped "
                      f"({kind}): a loop that never ends? Every step of an exercise takes "
                      f"well under a second; the lab is ready for the next try.{where}")


def run_on_ranks(name: str, lab, fn, *args):
    """lab.run(fn, *args) with a short timeout for collectives (the answer's computing is
    bounded by `time_bounded` around the whole check); whatever goes wrong becomes a
    `Stop`, except the time limit, which `check` turns into feedback."""
    try:
        return lab.run(fn, *args, timeout=CHECK_TIMEOUT_S)
    except CellTimeout:
        raise
    except TypeError as err:
        if "cannot be sent to the ranks" not in str(err) or err.__cause__ is None:
            raise
        cause = err.__cause__
        raise fail(name, f"your answer cannot be sent to the ranks ({type(cause).__name__}: "
                         f"{cause}): define it in the notebook or an importable module, and "
                         "keep things that cannot be copied to another process (locks, "
                         "open files, connections) out of it") from None
    except CollectiveHang as err:
        raise fail(name, "your answer waits in a collective that not every rank reaches: "
                         "every rank must call the same collectives in the same order "
                         f"(a collective under `if rank == ...` hangs).\n{err}") from None
    except RankDied as err:
        raise fail(name, f"a rank died while running your answer:\n{err}") from None
    except PlanError as err:
        raise fail(name, f"your plan does not fit the model: {err}") from None
    except RankError as err:
        groups: dict[str, list[int]] = {}
        for rank, tb in err.tracebacks.items():
            groups.setdefault(_last_line(tb) + _user_line(tb, answer_sources(args)),
                              []).append(rank)
        parts = [f"on {format_rank_list(ranks)}: {text}" for text, ranks in groups.items()]
        raise fail(name, "your answer raised an exception " + "; ".join(parts)) from None
    except LabError as err:
        raise fail(name, f"the lab could not run your answer: {err}") from None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def close(a, b, atol: float = 1e-4) -> bool:
    return (a is not None and b is not None and tuple(a.shape) == tuple(b.shape)
            and torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-4))


def spread(values: list[torch.Tensor]) -> float:
    """How far the ranks' tensors are from each other (0 when they agree)."""
    return max((max_diff(v, values[0]) for v in values[1:]), default=0.0)


def shape(t) -> tuple:
    return tuple(t.shape)


def fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "no collective"
