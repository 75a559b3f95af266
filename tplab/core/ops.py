"""The collective ops tplab names: one table for the trace, the hang watch, the cost model,
the calibration, the conjugates `Trace.explain()` states and the figures' markers.

A trace record's "op" is one of these names (docs/CONTRACTS.md); torch's many spellings of
each (`all_gather_into_tensor`, `_allgather_base_`, funcol's `all_gather_tensor`...) map to
it with `family`. `conjugate` is the same operator's collective in the other pass
(Shoeybi et al. 2019, section 3; docs/DESIGN.md's table): all-reduce <-> identity,
all-gather <-> reduce-scatter, all-to-all <-> all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BROADCAST, REDUCE, GATHER, SCATTER = "broadcast", "reduce", "gather", "scatter"
SEND, RECV, BARRIER = "send", "recv", "barrier"


@dataclass(frozen=True)
class Op:
    """One collective: `name` (a record's "op"), `conjugate` (the op of the other pass; ""
    for the identity), `reduces` (sums the ranks' values: its backward or forward partner
    is a copy), `label`, `symbol`, `words` (what a figure draws: bar label, plotly marker,
    hover text)."""

    name: str
    conjugate: str
    reduces: bool
    label: str
    symbol: str
    words: str


TABLE: dict[str, Op] = {op.name: op for op in (
    Op(ALL_REDUCE, "", True, "AR", "circle", "all-reduce"),
    Op(ALL_GATHER, REDUCE_SCATTER, False, "AG", "diamond", "all-gather"),
    Op(REDUCE_SCATTER, ALL_GATHER, True, "RS", "square", "reduce-scatter"),
    Op(ALL_TO_ALL, ALL_TO_ALL, False, "A2A", "star", "all-to-all"),
    Op(BROADCAST, REDUCE, False, "BC", "triangle-down", "broadcast"),
    Op(SEND, RECV, False, "send", "triangle-right", "send"),
    Op(RECV, SEND, False, "recv", "triangle-left", "recv"),
    Op(BARRIER, BARRIER, False, "bar", "line-ns", "barrier"),
    Op(REDUCE, BROADCAST, True, REDUCE, "circle", REDUCE),
    Op(GATHER, SCATTER, False, GATHER, "circle", GATHER),
    Op(SCATTER, GATHER, False, SCATTER, "circle", SCATTER),
)}
# the four collectives of tensor parallelism (what `tplab.cost.calibrate` measures)
TP_OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
# the ops the cost model prices (`tplab.cost.collective_time`)
COSTED = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, SEND, RECV, BARRIER)
# the ops NCCL's tuning model covers (ring and tree algorithms, `tplab.cost.nccl`)
NCCL_TUNED = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)


def family(api: str) -> str:
    """all_gather_into_tensor, _all_gather_base, all_gather_tensor... -> "all_gather"."""
    for op in TP_OPS:
        if op in api:
            return op
    return api


def conjugate(op: str) -> str | None:
    """The op of the conjugate collective in the other pass ("" = the identity), None for
    an op this table does not know."""
    entry = TABLE.get(op)
    return entry.conjugate if entry else None
