"""A wall-clock limit on the learner's own Python code in this process: `with
stop_after(30): fn()` raises `TimeLimitReached` in fn's code once 30 s have passed.

Rank processes have `cell_timeout` (the watchdog interrupts them, tplab/lab/watchdog.py);
`tplab.simulate` runs every rank in the notebook's own process, where there is nobody to
send the interrupt and preempting torch or tplab in the middle of an operation could leave
their state half-changed. So the limit is checked only between the bytecodes of the
learner's code: a trace function (`sys.settrace`, per thread) watches frames whose code is
neither the standard library, nor an installed package, nor tplab, and raises there, as if
the learner's line had raised. Library frames run untraced at full speed.

What it cannot stop: a single torch operation that runs long (one huge matmul), or a loop
inside library code; those finish first (the stop button still interrupts them). A
debugger or coverage tool that traces this thread is set aside while the limit runs and
restored after.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import time

_LIBRARY_DIRS = tuple({os.path.realpath(p) + os.sep for key in ("stdlib", "platstdlib",
                                                                  "purelib", "platlib")
                       if (p := sysconfig.get_paths().get(key))}
                      | {os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep})


class TimeLimitReached(BaseException):
    """Raised in the learner's code when its time is up. A BaseException (as
    KeyboardInterrupt), so that `except Exception` in the learner's code cannot swallow it."""


_CELL_NAMES = ("<ipython-input-", "<ranks cell", "<cell")
_SEEN: dict[str, bool] = {}  # file name -> is_learner_code, asked once per file


def is_learner_code(filename: str) -> bool:
    """True for code the learner wrote: a notebook cell, a script, a test; not the standard
    library, an installed package or tplab."""
    found = _SEEN.get(filename)
    if found is None:
        if filename.startswith("<"):
            # a cell (IPython's <ipython-input-...>, %%ranks' <ranks cell>); not code that
            # libraries generate (<string>: dataclasses, namedtuples) or <frozen importlib>,
            # which run inside imports that must not be cut in half
            found = filename.startswith(_CELL_NAMES)
        elif "site-packages" in filename or "dist-packages" in filename:
            found = False
        else:
            found = not os.path.realpath(filename).startswith(_LIBRARY_DIRS)
        _SEEN[filename] = found
    return found


class _Limit:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.reached = False  # True once it raised (even if the learner's code caught it)

    def on_call(self, frame, event, arg):
        if not is_learner_code(frame.f_code.co_filename):
            return None
        frame.f_trace_opcodes = True  # `while True: pass` has no new line to trace
        return self.on_step

    def on_step(self, frame, event, arg):
        if time.monotonic() > self.deadline:
            self.reached = True
            raise TimeLimitReached(f"your code ran past the time limit of {self.seconds:g} s")
        return self.on_step


@contextlib.contextmanager
def stop_after(seconds: float):
    """Run the block with the learner's code limited to `seconds` of wall-clock time; yields
    the limit, whose `.reached` says whether it stopped the code."""
    limit = _Limit(seconds)
    previous = sys.gettrace()
    sys.settrace(limit.on_call)
    try:
        yield limit
    finally:
        sys.settrace(previous)
