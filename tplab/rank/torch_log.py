"""Torch's own log of a failed sharding propagation, kept out of the notebook.

When DTensor cannot propagate an op (a plan whose layouts do not chain: "a and b must have
same reduction dim"), `torch._subclasses.fake_tensor` logs the whole meta-kernel traceback
at ERROR level ("failed while attempting to run meta for aten.mm.default", about 20 lines)
before DTensor raises, once per op and rank, through the handler `torch._logging` puts on
the "torch" logger: stderr. On a rank, stderr is what the notebook shows; the exception
itself already travels in the RankError. So these loggers write to a file of the rank's
own instead, `<state_dir>/output/<pid>.torch.log` next to its .out and .err files (and, in
`tplab.simulate`, a file in the temporary folder while a simulated cell runs): nothing is
lost, and a RankError says where the log is.

`torch._logging.set_logs(...)` (or TORCH_LOGS) resets torch's loggers: asking for torch's
logs that way brings them back to stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

# the loggers that speak when a DTensor op's sharding propagation fails
LOGGERS = ("torch._subclasses.fake_tensor", "torch.distributed.tensor._dispatch",
           "torch.distributed.tensor._sharding_prop")


class Routed:
    """Where the records went: `path`, and `wrote` (whether anything was written)."""

    def __init__(self, path: str):
        self.path = path
        self.start = _size(path)

    @property
    def wrote(self) -> bool:
        return _size(self.path) > self.start


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _route(path: str) -> tuple[logging.Handler, list]:
    handler = logging.FileHandler(path, delay=True, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    before = []
    for name in LOGGERS:  # torch._logging gives some of them a stderr handler of their own
        logger = logging.getLogger(name)
        before.append((logger, logger.propagate, list(logger.handlers)))
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
    return handler, before


def route_to_file(path: str) -> Routed:
    """For a rank process, for its whole life: the loggers write to `path` only."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    _route(path)
    return Routed(path)


def default_path() -> str:
    """This process's torch log when it has no lab state folder (tplab.simulate)."""
    return os.path.join(tempfile.gettempdir(), f"tplab-torch-{os.getpid()}.log")


@contextlib.contextmanager
def routed_to_file(path: str | None = None):
    """While the block runs (a simulated cell), the loggers write to `path` only; yields a
    `Routed`. Restored afterwards: the notebook's own torch code logs as before."""
    routed = Routed(path or default_path())
    handler, before = _route(routed.path)
    try:
        yield routed
    finally:
        for logger, propagate, handlers in before:
            logger.removeHandler(handler)
            for old in handlers:
                logger.addHandler(old)
            logger.propagate = propagate
        handler.close()
