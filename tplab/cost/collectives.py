"""The alpha-beta model of one collective: time = latency term + bytes term.

`nbytes` follows the trace records' convention (docs/CONTRACTS.md): all_reduce the tensor,
all_gather the gathered output, reduce_scatter the input before scattering, all_to_all the
input. With N ranks, alpha seconds per step and bandwidth B bytes/s one way per rank:

| op | ring: steps x alpha | bytes term |
|---|---|---|
| reduce_scatter, all_gather | (N-1) alpha | nbytes (N-1)/N / B |
| all_reduce = reduce_scatter + all_gather | 2(N-1) alpha | 2 nbytes (N-1)/N / B |
| all_to_all (pairwise) | (N-1) alpha | nbytes (N-1)/N / B |
| all_reduce, double binary tree | 2 ceil(log2 N) alpha | 2 nbytes / B |
| broadcast (pipelined chain) | (N-1) alpha | nbytes / B |

The ring terms are Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations" (2009), and Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH" (2005). The tree is NCCL's double binary
tree (Sanders, Speck and Traeff 2009); NCCL's tuner (src/graph/tuning.cc) uses the same
shapes: ring bus bandwidth x N / nsteps, tree bus bandwidth x 1/2, latency steps as above.
The tree only matters for small all-reduces over many ranks, where latency dominates;
`algorithm="auto"` takes the faster of the two, as NCCL's tuner does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tplab.cost.hardware import Hardware, Link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send",
       "recv", "barrier")


def collective_terms(op: str, nbytes: float, group_size: int, link: Link | Hardware,
                     algorithm: str = "ring") -> tuple[float, float]:
    """(latency term, bytes term) in seconds of one collective; see the module's table.

    `link` may be a `Hardware`, whose link for `group_size` ranks is then used.
    `algorithm` is "ring", "tree" or "auto"; it changes only all_reduce.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    if algorithm not in ("ring", "tree", "auto"):
        raise ValueError(f"algorithm must be 'ring', 'tree' or 'auto', not {algorithm!r}")
    n = group_size
    if n <= 1:
        return 0.0, 0.0
    if isinstance(link, Hardware):
        link = link.link(n)
    alpha, bw = link.params(op)
    if op == "all_reduce" and algorithm != "ring":
        tree = 2 * math.ceil(math.log2(n)) * alpha, 2 * nbytes / bw
        if algorithm == "tree":
            return tree
        ring = collective_terms(op, nbytes, n, link, "ring")
        return min(ring, tree, key=sum)
    if op in ("send", "recv"):
        return alpha, nbytes / bw
    if op == "broadcast":
        return (n - 1) * alpha, nbytes / bw
    if op == "barrier":
        return 2 * (n - 1) * alpha, 0.0
    factor = 2 if op == "all_reduce" else 1
    return factor * (n - 1) * alpha, factor * nbytes * (n - 1) / n / bw


def collective_time(op: str, nbytes: float, group_size: int, link: Link | Hardware,
                    algorithm: str = "ring") -> float:
    """Seconds one collective takes: latency term + bytes term (`collective_terms`)."""
    return sum(collective_terms(op, nbytes, group_size, link, algorithm))


def records_time(records: Iterable[dict], link: Link | Hardware, algorithm: str = "ring",
                 rank: int | None = None) -> float:
    """Seconds the collectives in `records` take on `link`, run one after another.

    `records` are trace records (`tplab.trace().records`) or predicted ones: dicts with
    op, bytes and group_size. Every rank issues the same collectives, so only one rank's
    records count: `rank`, or the lowest rank present.
    """
    records = list(records)
    ranks = {r.get("rank", 0) for r in records}
    if ranks:
        rank = min(ranks) if rank is None else rank
    return sum(collective_time(r["op"], r["bytes"], r["group_size"], link, algorithm)
               for r in records if r.get("rank", 0) == rank)
