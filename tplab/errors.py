"""Errors raised by tplab, and how their messages name ranks (`format_rank_list`). Every one
is a `LabError`, so a notebook can catch them all."""

from __future__ import annotations


def format_rank_list(ranks) -> str:
    """[0, 1, 2, 3] -> "ranks 0-3"; [0, 2] -> "ranks 0,2"; [1] -> "rank 1"."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}-{prev}" if prev - start >= 2 else
                     ",".join(str(x) for x in range(start, prev + 1)))
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(spans)


class LabError(Exception):
    """Base class of everything tplab raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through tplab's own code: what went
        # wrong on the ranks is in the message (with the ranks' own tracebacks).
        return [f"{type(self).__module__}.{type(self).__name__}: {self}".replace(
            "tplab.errors.", "tplab.")]


class RankError(LabError):
    """Code raised an exception on one or more ranks.

    `tracebacks` maps rank -> that rank's full traceback text; identical tracebacks
    are printed once with the list of ranks that raised them.
    """

    def __init__(self, tracebacks: dict[int, str], world_size: int | None = None,
                 ename: dict[int, str] | None = None):
        self.tracebacks = dict(sorted(tracebacks.items()))
        self.world_size = world_size
        self.enames = ename or {}
        super().__init__(self._message())

    @property
    def ranks(self) -> list[int]:
        return list(self.tracebacks)

    def _message(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank, tb in self.tracebacks.items():
            groups.setdefault(tb, []).append(rank)
        n = len(self.tracebacks)
        of = f" of {self.world_size}" if self.world_size else ""
        head = f"{n} rank{'s' if n != 1 else ''}{of} raised an exception"
        parts = [head]
        for tb, ranks in groups.items():
            parts.append(f"--- [{format_rank_list(ranks)}] ---\n{tb.rstrip()}")
        return "\n".join(parts)


class RankDied(LabError):
    """A rank process exited while the lab was using it (crash, signal, os._exit, OOM)."""

    def __init__(self, message: str, ranks: dict[int, str] | None = None):
        self.ranks = ranks or {}
        super().__init__(message)


class CollectiveHang(LabError):
    """Ranks waited in collectives that could not complete; the message says which rank
    waits where, and why. `restarted` is False when the stuck ranks were freed without a
    restart (names survive, but the cell's results are not valid); `results` has the
    values of the ranks that finished; `recovery_s` the seconds the recovery took (the
    restart, or completing the missed collectives)."""

    def __init__(self, message: str, where: dict[int, dict] | None = None,
                 recovered: bool = False, recovery_s: float | None = None,
                 restarted: bool = True, results: dict | None = None):
        self.where = where or {}
        self.recovered = recovered
        self.recovery_s = recovery_s
        self.restarted = restarted
        self.results = results or {}
        super().__init__(message)


class CellTimeout(LabError):
    """A cell ran past its `cell_timeout` (a wall-clock limit, off unless asked for); the
    message says what each rank was doing."""

    def __init__(self, message: str, where: dict[int, dict] | None = None):
        self.where = where or {}
        super().__init__(message)


class PlanError(LabError, ValueError):
    """A tensor-parallel plan that does not fit the model or the mesh."""


class RankPlanError(RankError, PlanError):
    """A PlanError raised on the ranks (apply_plan inside a cell): caught by
    `except tplab.PlanError` as well as by `except tplab.RankError`."""
