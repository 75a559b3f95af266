"""Typed records read as the dicts they replace: a report row, a trace record.

A record is a frozen dataclass (its fields are its keys, written once) that also reads by
key, `row["ok"]`, `row.get("note")`, `"op" in record`, `dict(record)`, `{**record}`: what
notebooks and tests wrote when rows were dicts keeps working. Change one with
`dataclasses.replace(row, note=...)`, not by assignment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

__all__ = ["CollectiveRecord", "Record"]


class Record(Mapping):
    """Mixin for a frozen dataclass: a read-only Mapping of its fields (see the module doc),
    so that what takes a Mapping (a figure's records, `dict(r)`) takes it too. Equality and
    hashing stay the dataclass's."""

    __slots__ = ()

    def __getitem__(self, key: str):
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


@dataclasses.dataclass(frozen=True)
class CollectiveRecord(Record):
    """One collective a rank issued, as `tplab.trace` records it (docs/CONTRACTS.md): the
    rank, its place in the rank's sequence, the pass ("forward"/"backward"), the module
    running, the op (tplab.core.ops' names), the message's shape, dtype and bytes, the
    group's label and size, when it was issued and how long it took (ms, from the trace's
    start), and why it ran (tplab.causes)."""

    rank: int
    seq: int
    phase: str
    module: str
    op: str
    shape: tuple
    dtype: str
    bytes: int
    group: str
    group_size: int
    duration_ms: float = 0.0
    start_ms: float = 0.0
    cause: str = ""
