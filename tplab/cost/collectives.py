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

Those shapes are what a plain `Link` (no `kind`: a calibrated one, or one made by hand)
runs: latency term = base_latency + steps x alpha, one protocol. A link with a `kind`
(every nccl-tests preset) and every `Hardware` run NCCL's own model instead
(`tplab.cost.nccl`, NCCL 2.21.5's src/graph/tuning.cc): algorithms ring, tree, NVLS and
CollNet (where the hardware has them) x protocols LL, LL128 and Simple, each with its own
latencies and bandwidth efficiency, and NCCL's choice by message size. `algorithm=` and
`protocol=` force one ("auto": NCCL's choice); `collective_plan` says which was taken.
`algorithm="ring"` (the default, what `NCCL_ALGO=Ring` forces) lets NCCL pick only the
ring's protocol: a number priced so is "ring (NCCL_ALGO=Ring)", not NCCL's own choice,
which on one NVSwitch node takes NVLS for all-reduces from about 1 MB (`algorithm="auto"`).
All-gather and reduce-scatter are modelled as rings only (module doc of `tplab.cost.nccl`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tplab.core import ops
from tplab.cost import nccl
from tplab.cost.hardware import Hardware, Link
from tplab.cost.validate import check_choice, check_int, check_number, check_type

OPS = ops.COSTED
ALGORITHMS = ("ring", "tree", "auto", "nvls", "collnet_direct", "collnet_chain")
PROTOCOLS = ("auto", *nccl.PROTOCOLS)
REDUCTIONS = ops.NCCL_TUNED  # the ops NCCL's ring/tree model covers


def check_collective(op, nbytes, group_size, link, algorithm, protocol) -> None:
    """The one check of a collective's arguments (tplab.cost.validate)."""
    check_choice("op", op, OPS)
    check_number("nbytes", nbytes)
    check_int("group_size", group_size)
    check_type("link", link, Link | Hardware, "a tplab.cost.Link or Hardware")
    check_choice("algorithm", algorithm, ALGORITHMS)
    check_choice("protocol", protocol, PROTOCOLS)


def _plain(op, nbytes, n, link, algorithm, protocol) -> tuple[float, float, str, str]:
    """The alpha-beta shapes of the module's table, for a link with no NCCL kind."""
    if protocol not in ("auto", "Simple"):
        raise ValueError(f"protocol={protocol!r}: {link.name} is a plain alpha-beta link "
                         "(no kind), with one protocol; give it kind= for NCCL's protocols")
    if algorithm.startswith("collnet"):
        raise ValueError(f"algorithm={algorithm!r} needs a Hardware with collnet=True")
    alpha, bw = link.params(op)
    base = link.base_latency
    if op == "all_reduce" and algorithm != "ring":
        candidates = {}
        if algorithm in ("tree", "auto"):
            candidates["tree"] = (base + 2 * math.ceil(math.log2(n)) * alpha, 2 * nbytes / bw)
        if algorithm in ("nvls", "auto") and link.nvls_bandwidth > 0:
            candidates["nvls"] = (base + 2 * alpha,
                                  2 * nbytes * (n - 1) / n / link.nvls_bandwidth)
        if algorithm == "nvls" and "nvls" not in candidates:
            raise ValueError(f"algorithm='nvls' needs an NVSwitch link with nvls_bandwidth; "
                             f"{link.name} has none")
        candidates["ring"] = _plain(op, nbytes, n, link, "ring", protocol)[:2]
        if algorithm != "auto":
            return (*candidates[algorithm], algorithm, "Simple")
        name = min(candidates, key=lambda k: sum(candidates[k]))
        return (*candidates[name], name, "Simple")
    if op in ("send", "recv"):
        return base + alpha, nbytes / bw, "p2p", "Simple"
    if op == "broadcast":
        return base + (n - 1) * alpha, nbytes / bw, "ring", "Simple"
    if op == "barrier":
        return base + 2 * (n - 1) * alpha, 0.0, "ring", "Simple"
    factor = 2 if op == "all_reduce" else 1
    return (base + factor * (n - 1) * alpha, factor * nbytes * (n - 1) / n / bw, "ring",
            "Simple")


def collective_plan(op: str, nbytes: float, group_size: int, link: Link | Hardware,
                    algorithm: str = "ring", protocol: str = "auto") -> dict:
    """How one collective runs: {algorithm, protocol, latency_s, bytes_s, time_s,
    bus_bandwidth} (bus bandwidth as nccl-tests reports it: the all-reduce's
    2 (N-1)/N x nbytes / time, (N-1)/N x nbytes / time for the others)."""
    check_collective(op, nbytes, group_size, link, algorithm, protocol)
    n = group_size
    if n == 1:
        lat, transfer, a, p = 0.0, 0.0, "none", "none"
    elif isinstance(link, Link) and not link.kind or (
            isinstance(link, Hardware) and not link.intra.kind):
        plain = link.link(n, op) if isinstance(link, Hardware) else link
        lat, transfer, a, p = _plain(op, nbytes, n, plain, algorithm, protocol)
    else:
        group = nccl.Group(n, link, op)
        if op in REDUCTIONS or op == "barrier":
            reduce_op = "all_reduce" if op == "barrier" else op
            if op != "all_reduce" and algorithm not in ("ring", "auto"):
                raise ValueError(
                    f"algorithm={algorithm!r}: tplab models {op} as a ring only (NCCL 2.21.5 "
                    "also runs it with NVLS inside one node, enqueue.cc, which tplab does not "
                    "model); use algorithm='ring' or 'auto'")
            lat, transfer, a, p = nccl.terms(reduce_op, 0.0 if op == "barrier" else nbytes,
                                             group, algorithm, protocol)
        else:
            if algorithm not in ("ring", "auto") or protocol not in ("auto", "Simple"):
                raise ValueError(f"{op} is point-to-point in NCCL: algorithm='ring' or "
                                 "'auto' and protocol 'Simple' or 'auto' only")
            (lat, transfer), a, p = nccl.point_to_point(op, nbytes, group), "p2p", "Simple"
    time = lat + transfer
    factor = {"all_reduce": 2 * (n - 1) / n}.get(op, (n - 1) / n if n > 1 else 0)
    return {"op": op, "bytes": nbytes, "group_size": n, "algorithm": a, "protocol": p,
            "latency_s": lat, "bytes_s": transfer, "time_s": time,
            "bus_bandwidth": factor * nbytes / time if time > 0 else 0.0}


def collective_terms(op: str, nbytes: float, group_size: int, link: Link | Hardware,
                     algorithm: str = "ring", protocol: str = "auto") -> tuple[float, float]:
    """(latency term, bytes term) in seconds of one collective; see the module doc.

    `link` may be a `Hardware`, whose link for `group_size` ranks is then used (and, for a
    group across nodes, NVLink steps and network steps apart). `algorithm`: "ring",
    "tree", "nvls", "collnet_direct", "collnet_chain" or "auto" (all but the ring change
    only all_reduce); `protocol`: "LL", "LL128", "Simple" or "auto" (NCCL's choice).
    """
    plan = collective_plan(op, nbytes, group_size, link, algorithm, protocol)
    return plan["latency_s"], plan["bytes_s"]


def collective_time(op: str, nbytes: float, group_size: int, link: Link | Hardware,
                    algorithm: str = "ring", protocol: str = "auto") -> float:
    """Seconds one collective takes: latency term + bytes term (`collective_terms`)."""
    return sum(collective_terms(op, nbytes, group_size, link, algorithm, protocol))


def records_time(records: Iterable[dict], link: Link | Hardware, algorithm: str = "ring",
                 rank: int | None = None, protocol: str = "auto") -> float:
    """Seconds the collectives in `records` take on `link`, run one after another.

    `records` are trace records (`tplab.trace().records`) or predicted ones: dicts with
    op, bytes and group_size. Every rank issues the same collectives, so only one rank's
    records count: `rank`, or the lowest rank present.
    """
    if isinstance(records, dict | str) or not isinstance(records, Iterable):
        raise TypeError(f"records must be a list of trace records (dicts), got "
                        f"{type(records).__name__}")
    records = list(records)
    for r in records:
        if not isinstance(r, dict) or not {"op", "bytes", "group_size"} <= set(r):
            raise ValueError(f"records must be dicts with op, bytes and group_size, got {r!r}")
    if rank is not None:
        check_int("rank", rank, minimum=0)
    ranks = {r.get("rank", 0) for r in records}
    if ranks:
        rank = min(ranks) if rank is None else rank
    return sum(collective_time(r["op"], r["bytes"], r["group_size"], link, algorithm,
                               protocol)
               for r in records if r.get("rank", 0) == rank)
