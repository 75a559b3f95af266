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

Three refinements of NCCL's own model (src/graph/tuning.cc) on top of those shapes:

- every call also pays the link's `base_latency` (NCCL's `baseLat`, 8.4 us for a ring with
  the Simple protocol), whatever its size: latency term = base + steps x alpha;
- given a `Hardware`, a group that spans k nodes takes its steps between nodes at the
  network's alpha and the others at NVLink's: for a ring all-reduce 2(k-1) network steps
  and 2(N-k) NVLink steps (NCCL's nInterSteps), and its bytes at the striped NICs' rate
  (`Hardware.link`);
- `algorithm="nvls"`: an all-reduce reduced inside the NVSwitch (NVLink SHARP, H100 and
  later): each GPU sends its data into the switch once and gets the sum back once, so the
  latency is 2 alpha, not 2(N-1) alpha, and the bytes term is 2 bytes (N-1)/N over the
  link's `nvls_bandwidth`, which is quoted as a bus bandwidth like the ring's (nccl-tests
  reports every all-reduce with the ring's factor 2(N-1)/N). Only inside one NVLink
  domain; "auto" takes it where the link has it and it is faster.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tplab.cost.hardware import Hardware, Link

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send",
       "recv", "barrier")


ALGORITHMS = ("ring", "tree", "auto", "nvls")


def collective_terms(op: str, nbytes: float, group_size: int, link: Link | Hardware,
                     algorithm: str = "ring") -> tuple[float, float]:
    """(latency term, bytes term) in seconds of one collective; see the module's table.

    `link` may be a `Hardware`, whose link for `group_size` ranks is then used (and, for a
    group across nodes, NVLink steps and network steps apart). `algorithm` is "ring",
    "tree", "nvls" or "auto"; it changes only all_reduce.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    n = group_size
    if n <= 1:
        return 0.0, 0.0
    given, nodes, intra_alpha = link, 1, None
    if isinstance(link, Hardware):
        nodes = link.nodes(n)
        intra_alpha = link.intra.params(op)[0]
        link = link.link(n)
    alpha, bw = link.params(op)
    base = link.base_latency

    def steps(count: int) -> float:   # `count` ring steps, (nodes - 1) per pass between nodes
        if nodes == 1:
            return count * alpha
        passes = count // (n - 1) if count >= n - 1 else 1
        inter = passes * (nodes - 1)
        return (count - inter) * intra_alpha + inter * alpha

    if op == "all_reduce" and algorithm != "ring":
        candidates = {}
        if algorithm in ("tree", "auto"):
            candidates["tree"] = (base + 2 * math.ceil(math.log2(n)) * alpha, 2 * nbytes / bw)
        if algorithm in ("nvls", "auto") and link.nvls_bandwidth > 0 and nodes == 1:
            candidates["nvls"] = (base + 2 * alpha,
                                  2 * nbytes * (n - 1) / n / link.nvls_bandwidth)
        if algorithm == "nvls" and "nvls" not in candidates:
            raise ValueError(f"algorithm='nvls' needs an NVSwitch link with nvls_bandwidth "
                             f"inside one node; {link.name} over {n} GPUs has none")
        if algorithm != "auto":
            return candidates[algorithm]
        candidates["ring"] = collective_terms(op, nbytes, n, given)
        return min(candidates.values(), key=sum)
    if op in ("send", "recv"):
        return base + alpha, nbytes / bw
    if op == "broadcast":
        return base + steps(n - 1), nbytes / bw
    if op == "barrier":
        return base + steps(2 * (n - 1)), 0.0
    factor = 2 if op == "all_reduce" else 1
    return base + steps(factor * (n - 1)), factor * nbytes * (n - 1) / n / bw


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
