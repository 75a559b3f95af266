"""NCCL's own cost model of a collective: algorithms x protocols, and its choice between them.

This follows `ncclTopoTuneModel` and `ncclTopoGetAlgoTime` in NCCL 2.21.5's
src/graph/tuning.cc (tag v2.21.5-1; the tables below are copied from it, in microseconds):
for each algorithm a and protocol p a latency `baseLat[a][p]` per call plus `hwLat[hw][a][p]`
per step (hw: NVLink, PCI or the network), and a bandwidth that is the ring's bus bandwidth
times a per-protocol efficiency, capped; time = latency + bytes / algorithm bandwidth, and
NCCL takes the (a, p) with the smallest time.

| | LL | LL128 | Simple |
|---|---|---|---|
| ring baseLat | 6.6 | 14.0 | 8.4 |
| ring hwLat NVLink / PCI / net | 0.6 / 1.0 / 2.7 | 1.9 / 2.5 / 4.0 | 3.4 / 5.7 / 14.0 |
| tree baseLat | 6.8 | 14.0 | 0 |
| tree hwLat NVLink / PCI / net | 0.6 / 1.0 / 5.0 | 1.25 / 1.9 / 8.5 | 28 / 28 / 28 |
| ring bus bandwidth | min(llMax, B/2) | 0.92 B (0.7 B at 1 GPU per node) | B |
| tree bus bandwidth (T = 0.92 B) | min(llMax, T/3.8) | T x 7/9 (one node), x 120/128 | T |

NVLS (NVLink SHARP): Simple only, `hwLat` 25 us on NVLink and no `baseLat`; CollNet Direct
31 us and Chain 30 us on the network plus per-GPU terms (below). llMax (GB/s): one node by
GPU (Volta 39, Ampere 87.7, Hopper 141), several by CPU (Intel 39 / 20.4, AMD 22.5 / 19 for
2 / more nodes). Latency steps of a ring: all-reduce 2(N-1), of which 2 x nodes cross the
network when there are several (2.21's nInterSteps); all-gather and reduce-scatter N-1, of
which nodes-1. Between nodes every intra-node step costs at least the network overhead
(1 us on Intel, 2 on AMD; x3 for Simple), and a ring Simple all-reduce over several nodes
pays 1.4 x its latency (the "plateau effect"). Tree: 2 ((N/nodes - 1) intra + log2(nodes)
inter) steps, bytes at half its bus bandwidth, scaled by NCCL's size correction factors.
Algorithm bandwidth is bus bandwidth x N / nsteps for the ring, x 1/2 for tree and CollNet.

Where tplab departs from NCCL, and why:
- B, the Simple ring's bus bandwidth, is the measured nccl-tests figure (`Link.bandwidth`),
  not NCCL's count of channels x per-channel speed; the efficiencies are relative to it.
  NCCL's per-channel caps (LL128 36.7 GB/s per channel on Hopper, tree 38.7) do not bind
  at NVLink nodes' 16 or more channels and are left out; NCCL_CHANNELS = 16 sets when a
  message counts for the plateau (nbytes / (channels x N) >= 64).
- NVLS all-reduce: NCCL's own bandwidth is nChannels x per-channel bandwidth x 5/6;
  tplab uses instead the measured bus bandwidth `Link.nvls_bandwidth` (480 GB/s on H100,
  nccl-tests #212) converted as nccl-tests does, x N / (2 (N-1)), and chooses by that
  fixed figure, which picks NVLS from about 1.1 MB on 8 H100 (NCCL picks it from about
  2 MB, nccl-tests #309: "8B~1MB uses Ring LL, 2MB~16GB NVLS Simple"). The bandwidth it
  reaches grows with the message (#212), so the time returned, not the choice, uses
  `Link.nvls_bandwidth` x S / (S + `Link.nvls_ramp`).
- NVLSTree (all-reduce across nodes on NVSwitch systems: NVLS inside each node, a tree of
  the nodes over the NICs; NCCL 2.21.5 enables it whenever nNodes > 1): Simple only, no
  baseLat, 25 us (NVLink) + 2 log2(nodes) x 14 us (network) of latency, and an algorithm
  bandwidth of 5/6 x min(the node's in-switch rate, its striped NICs, halved past two
  nodes) (`nvls_tree_algbw`), ramping with the message like NVLS. On two DGX H100 nodes
  that is a bus bandwidth of about 430 GB/s, beside the ring's 384; on more nodes it is
  below the ring at large sizes (NVIDIA/nccl#1221: enabling NVLS raised 2 nodes from 330
  to 430 GB/s, and changed nothing on more). NVLS all-gather and reduce-scatter (inside
  one node, enqueue.cc) are not modelled: they run as rings.
- When every rank is its own node NCCL 2.21's nInterSteps (2 x nodes) exceeds nsteps by 2;
  NCCL's formula then counts -2 intra-node steps (a latency 2 hwLat smaller); tplab keeps
  the intra-node step count at 0.
- all-to-all, send/recv and broadcast are not in NCCL's tuning model (point-to-point): they
  take the Simple protocol's latencies, all-to-all (N-1) steps and, across nodes, one NIC
  per GPU.
"""

from __future__ import annotations

import math

from tplab.cost.hardware import NCCL_BASE_LATENCY, SIMPLE_STEP, Hardware, Link

PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "collnet_direct", "collnet_chain")
US = 1e-6
BASE_LAT = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 0.0), "nvls": (0, 0, 0),
            "nvls_tree": (0, 0, 0), "collnet_direct": (0, 0, 0), "collnet_chain": (0, 0, 0)}
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 28), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0, 0, 3.7),
               "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25)},
    "pci": {"tree": (1.0, 1.9, 28), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0, 0, 3.7),
            "collnet_chain": (0, 0, 2.8), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "net": {"tree": (5.0, 8.5, 28), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0, 0, 31),
            "collnet_chain": (0, 0, 30), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 14)},
}
LL_MAX_BW = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0),
             "hopper": (141.0, 45.0, 35.0)}          # GB/s; rows for several nodes by CPU
NET_OVERHEAD = {"intel": 1.0, "amd": 2.0}             # us (getNetOverhead)
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9,
              .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7,
               .7, .8, .9, .9)}
NCCL_CHANNELS = 16
NVLS_BY_GROUP = {2: 367, 3: 367, 4: 367, 5: 420, 6: 440, 7: 460, 8: 480}
"""NVLS all-reduce bus bandwidth (GB/s) by group size on H100, measured in NVIDIA/nccl
issue #1455: about 367 on 2-4 GPUs, 420, 440, 460 and 480 on 5, 6, 7 and 8; a link's
`nvls_bandwidth` is the 8-GPU figure and smaller groups take these fractions of it."""
P = {p: i for i, p in enumerate(PROTOCOLS)}


def log2i(n: int) -> int:
    """NCCL's log2i: floor(log2 n), 0 for n <= 1."""
    return max(0, int(n).bit_length() - 1)


class Group:
    """What NCCL's model sees of a group of `n` GPUs: nodes, GPUs per node, the link kinds,
    the Simple ring's bus bandwidth, and the scale of each link's latencies."""

    def __init__(self, n: int, where: Link | Hardware, op: str):
        if isinstance(where, Hardware):
            self.hw = where
            self.nodes = where.nodes(n)
            intra, inter = where.intra, where.inter
            self.link = where.link(n, op)
        else:
            net = where.kind == "net"
            self.hw = Hardware(where.name, 1.0, where, where, gpus_per_node=1 if net else n,
                               nics_per_node=1)
            self.nodes = n if net else 1
            intra = inter = where
            self.link = where
        self.n, self.ppn = n, n // self.nodes
        self.intra_kind = intra.kind if self.nodes == 1 or intra.kind != "net" else "pci"
        self.intra_scale = intra.latency / SIMPLE_STEP[intra.kind]
        self.inter_scale = inter.latency / SIMPLE_STEP[inter.kind] if inter.kind else 1.0
        self.base_scale = self.link.base_latency / NCCL_BASE_LATENCY
        self.bus = self.link.bandwidth
        self.intra = intra

    def hw_lat(self, kind: str, algorithm: str, protocol: str) -> float:
        scale = self.inter_scale if kind == "net" else self.intra_scale
        return HW_LAT[kind][algorithm][P[protocol]] * scale

    def ll_max(self) -> float:
        if self.nodes == 1:
            return LL_MAX_BW[self.hw.arch][0] * 1e9
        row = "ampere" if self.hw.cpu == "amd" else "volta"
        return LL_MAX_BW[row][1 if self.nodes == 2 else 2] * 1e9


def available(op: str, g: Group) -> list[tuple[str, str]]:
    """The (algorithm, protocol) pairs NCCL 2.21 would consider for `op` on this group."""
    protocols = [p for p in PROTOCOLS if p != "LL128" or g.intra.kind == "nvlink"]
    if op != "all_reduce":
        return [("ring", p) for p in protocols]
    pairs = [(a, p) for a in ("ring", "tree") for p in protocols]
    if g.intra.kind == "nvlink" and g.intra.nvls_bandwidth > 0 and g.ppn >= 2:
        pairs.append(("nvls" if g.nodes == 1 else "nvls_tree", "Simple"))   # NVLS: 2+ a node
    if g.nodes > 1 and g.hw.collnet:
        pairs.append(("collnet_chain", "Simple"))
        if g.intra.kind == "nvlink" and g.ppn <= 8:
            pairs.append(("collnet_direct", "Simple"))
    return pairs


def latency(op: str, algorithm: str, protocol: str, g: Group, nbytes: float) -> float:
    """Seconds of NCCL's latency for one call (baseLat + steps x hwLat, and the plateau)."""
    n, nodes, p = g.n, g.nodes, P[protocol]
    base = BASE_LAT[algorithm][p] * g.base_scale
    intra = g.hw_lat(g.intra_kind, algorithm, protocol)
    inter = g.hw_lat("net", algorithm, protocol)
    if algorithm == "ring":
        nsteps = 2 * (n - 1) if op == "all_reduce" else n - 1
        inter_steps = (2 * nodes if nodes > 1 else 0) if op == "all_reduce" else nodes - 1
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD[g.hw.cpu] * (3 if protocol == "Simple" else 1))
        lat = base + max(0, nsteps - inter_steps) * intra + min(nsteps, inter_steps) * inter
        if (protocol == "Simple" and nodes > 1 and op == "all_reduce"
                and nbytes / (NCCL_CHANNELS * n) >= 64):
            lat *= 1.4 if g.hw.arch != "volta" else 1.9   # the plateau effect of the ring
    elif algorithm == "tree":
        lat = base + 2 * ((g.ppn - 1) * intra + log2i(nodes) * inter)
    elif algorithm == "nvls":
        lat = intra
    elif algorithm == "nvls_tree":
        lat = g.hw_lat("nvlink", algorithm, protocol) + 2 * log2i(nodes) * inter
    elif algorithm == "collnet_direct":
        lat = base + 2 * (min(1, g.ppn - 1) * intra + (g.ppn - 1) * 0.4) + inter
    else:
        lat = base + 2 * (g.ppn - 1) * intra + inter
    return lat * US


def bus_bandwidth(algorithm: str, protocol: str, g: Group) -> float:
    """NCCL's bus bandwidth (bytes/s) for (algorithm, protocol), from the Simple ring's."""
    b = g.bus
    if algorithm == "ring":
        return {"Simple": b, "LL": min(g.ll_max(), b / 2),
                "LL128": b * (0.92 if g.ppn >= 2 else 0.7)}[protocol]
    if algorithm == "tree":
        t = 0.92 * b
        return {"Simple": t, "LL": min(t / 3.8, g.ll_max()),
                "LL128": t * (7 / 9 if g.nodes == 1 else 120 / 128)}[protocol]
    if algorithm == "nvls":
        return g.intra.nvls_bandwidth * NVLS_BY_GROUP.get(g.n, 480) / 480
    if algorithm == "nvls_tree":
        return nvls_tree_algbw(g) * 2 * (g.n - 1) / g.n
    b = g.intra.bandwidth
    return b * (0.85 if g.hw.arch == "hopper" else 1.0) if algorithm == "collnet_direct" else b


def nvls_tree_algbw(g: Group) -> float:
    """NVLSTree's algorithm bandwidth (bytes/s): NCCL 2.21.5 (tuning.cc) takes
    nChannels x min(bwIntra, bwInter, halved past 2 nodes) x 5/6. In tplab's measured terms:
    the in-switch reduction of the node's GPUs (NVLS's measured bus bandwidth for that group
    size, as algorithm bandwidth) against the node's striped NICs (the cross-node ring's
    bus bandwidth, which moves each byte once each way on two nodes; past two, a tree node
    relays to its parent and its children: half), times NCCL's 5/6."""
    ppn = g.ppn
    intra = g.intra.nvls_bandwidth * NVLS_BY_GROUP.get(ppn, 480) / 480 * ppn / (2 * (ppn - 1))
    nics = g.bus if g.nodes <= 2 else g.bus / 2
    return 5 / 6 * min(intra, nics)


def algorithm_bandwidth(op: str, algorithm: str, protocol: str, g: Group,
                        nbytes: float) -> float:
    """Bytes/s that `nbytes` moves at (nbytes / this = the bytes term), as NCCL converts
    bus bandwidth: x N / nsteps for the ring, x 1/2 for tree and CollNet; NVLS's measured
    bus bandwidth is converted with nccl-tests' factor 2 (N-1) / N."""
    n, bus = g.n, bus_bandwidth(algorithm, protocol, g)
    if algorithm == "ring":
        return bus * n / (2 * (n - 1) if op == "all_reduce" else n - 1)
    if algorithm in ("nvls", "nvls_tree"):
        return bus * n / (2 * (n - 1))
    if algorithm == "tree":
        size = log2i(int(nbytes) >> 6)
        if size < 23:
            bus *= TREE_CORRECTION[protocol][size]
    return bus / 2


def terms(op: str, nbytes: float, g: Group, algorithm: str = "auto",
          protocol: str = "auto") -> tuple[float, float, str, str]:
    """(latency s, bytes s, algorithm, protocol) of one reduction collective: NCCL's choice
    among the pairs `algorithm` and `protocol` allow ("auto": any), its time as measured
    (NVLS's bandwidth ramps with the message; see the module doc)."""
    pairs = [(a, p) for a, p in available(op, g)
             if algorithm in ("auto", a) and protocol in ("auto", p)]
    if not pairs:
        have = available(op, g)
        raise ValueError(f"algorithm={algorithm!r}, protocol={protocol!r}: NCCL has no such "
                         f"{op} on {g.link.name} over {g.n} GPUs ({g.nodes} node(s)); it has "
                         + ", ".join(f"{a}/{p}" for a, p in have))
    priced = {ap: priced_terms(op, *ap, g, nbytes) for ap in pairs}
    a, p = min(pairs, key=lambda ap: sum(priced[ap]))
    return (*priced[a, p], a, p)


def priced_terms(op: str, algorithm: str, protocol: str, g: Group,
                 nbytes: float) -> tuple[float, float]:
    """(latency s, bytes s) of one (algorithm, protocol) as tplab prices it: NCCL's model,
    with NVLS's bandwidth ramping with the message (module doc). `terms` chooses by this
    same price, so its choice is never slower than an alternative it prices (NCCL itself
    chooses NVLS by the fixed figure and can be slower than the ring it rejected: the
    third review's finding 2)."""
    lat = latency(op, algorithm, protocol, g, nbytes)
    bw = algorithm_bandwidth(op, algorithm, protocol, g, nbytes)
    if algorithm in ("nvls", "nvls_tree") and g.intra.nvls_ramp > 0:
        bw *= nbytes / (nbytes + g.intra.nvls_ramp) if nbytes > 0 else 1.0
    return lat, (nbytes / bw if nbytes > 0 else 0.0)


def point_to_point(op: str, nbytes: float, g: Group) -> tuple[float, float]:
    """all_to_all, send/recv, broadcast: Simple's latencies; an all-to-all across nodes at
    one NIC per GPU for the part that leaves the node, NVLink for the rest."""
    n = g.n
    base = BASE_LAT["ring"][P["Simple"]] * g.base_scale * US
    step = g.hw_lat("net" if g.nodes > 1 else g.intra_kind, "ring", "Simple") * US
    if op in ("send", "recv"):
        return base + step, nbytes / g.link.bandwidth
    if op == "broadcast":   # a pipelined chain: one step's latency, the message once
        return base + (n - 1) * step if g.nodes > 1 else base + step, nbytes / g.link.bandwidth
    off_node = (n - g.ppn) / n
    on_node = (g.ppn - 1) / n
    nvlink = g.intra.bandwidth
    nic = g.link.bandwidth if g.nodes > 1 else math.inf
    return base + (n - 1) * step, max(nbytes * off_node / nic, nbytes * on_node / nvlink)
