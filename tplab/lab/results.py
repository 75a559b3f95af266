"""The replies to one cell, rank by rank (an ipyparallel AsyncResult over several ranks)."""

from __future__ import annotations

import re

from ipyparallel import error as ipp_error

from tplab.core.output import strip_ansi
from tplab.core.transfer import from_wire, is_wire
from tplab.rank import runner as rank_side


class RankResults:
    """One ipyparallel AsyncResult over several ranks, looked at rank by rank."""

    def __init__(self, ar, ranks: list[int]):
        self.ar, self.ranks = ar, ranks
        self._futures = dict(zip(ranks, ar._children, strict=True))  # one per target
        self._replies: dict = {}

    def done(self, r: int) -> bool:
        return self._futures[r].done()

    def finished(self) -> list[int]:
        return [r for r in self.ranks if self._futures[r].done()]

    def pending(self) -> list[int]:
        return [r for r in self.ranks if not self._futures[r].done()]

    def reply(self, r: int):
        """The rank's Reply; an ipyparallel error (engine died...) is returned, not raised."""
        if r not in self._replies:
            try:
                message = self._futures[r].result()
            except Exception as exc:  # noqa: BLE001 - e.g. an EngineError
                message = exc
            self._replies[r] = decode(message)
        return self._replies[r]

    def value(self, r: int):
        reply = self.reply(r)
        return reply.value if isinstance(reply, rank_side.Reply) else reply


def decode(message):
    """A rank's reply as the notebook reads it: tplab's wire format decoded (transfer.py),
    anything else (an ipyparallel error...) as it came."""
    return from_wire(message) if is_wire(message) else message


def engine_died(value) -> bool:
    return isinstance(value, ipp_error.EngineError) or (
        isinstance(value, ipp_error.RemoteError) and value.ename == "EngineError")


def strip_engine_id(error) -> str:
    text = strip_ansi(str(error))
    return re.sub(r"^\[\d+:apply\]:?\s*", "", text)
