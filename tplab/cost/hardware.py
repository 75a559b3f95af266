"""Links and machines: the numbers the alpha-beta model runs on.

A `Link` is what one GPU sees of the wire its collectives use: `bandwidth` in bytes/s in
one direction, read as nccl-tests' *bus bandwidth* (the rate a ring moves data at, so
that an all-reduce of S bytes over N GPUs takes 2 S (N-1)/N / bandwidth), `latency`
(alpha) in seconds per step of a ring, `base_latency` in seconds per call (NCCL's fixed
cost of launching a collective, whatever its size) and, on NVSwitch systems,
`nvls_bandwidth`: the bus bandwidth of an all-reduce done in the switch (NVLink SHARP).

A `Hardware` is a GPU (its peak dense bf16 FLOP/s) in a node: collectives among up to
`gpus_per_node` GPUs use `intra`; larger groups cross nodes. Between nodes each GPU has a
NIC of its own (`inter` is ONE NIC, `nics_per_node` of them per node) and NCCL runs one
ring per NIC, striping the message over them, so a ring that leaves the node moves data
at nics_per_node x inter.bandwidth, up to the NVLink bandwidth it also crosses
(`Hardware.link`). Its latency is NCCL's: the steps inside a node at intra.latency, the
steps between nodes at inter.latency (src/graph/tuning.cc, `ncclTopoTuneModel`).

Sources. Datasheet peaks (`LINKS` "NVLink 4", "InfiniBand NDR", ...):

- NVLink 4, H100 SXM and H200 SXM: 900 GB/s bidirectional per GPU, so 450 GB/s each way
  (NVIDIA H100 Tensor Core GPU datasheet; NVIDIA H200 Tensor Core GPU datasheet).
- NVLink 3, A100 SXM: 600 GB/s bidirectional, 300 GB/s each way (NVIDIA A100 datasheet).
- PCIe Gen4 x16: 64 GB/s bidirectional, 32 GB/s each way (A100 PCIe datasheet; PCI-SIG:
  16 GT/s per lane). PCIe Gen5 x16: 128 GB/s bidirectional, 64 GB/s each way (H100 PCIe
  datasheet; PCI-SIG: 32 GT/s per lane).
- InfiniBand NDR: 400 Gb/s = 50 GB/s per HCA, one ConnectX-7 per GPU, 8 per DGX H100/H200
  (NVIDIA DGX H100 user guide). InfiniBand HDR: 200 Gb/s = 25 GB/s per HCA, 8 ConnectX-6
  per DGX A100 (DGX A100 user guide).

Measured bus bandwidth (`LINKS` "... (nccl-tests)", what the `HARDWARE` presets use):

- NVLink 4, ring: 370 GB/s ("with the protocol overhead (~20%) NCCL can get an effective
  NVLink bandwidth of 370GB/s"); all-reduce with NVLink SHARP on 8 H100: a peak bus
  bandwidth of about 480 GB/s, algorithm bandwidth 275 GB/s. S. Jeaugey (NCCL), in
  NVIDIA/nccl-tests issue #212 (2024).
- NVLink 3 (A100): NCCL's own tuning model caps an A100's bus bandwidth at 235 GB/s
  (src/graph/tuning.cc, `if (compCap80) busBw = std::min(busBw, 235.0f)`).
- InfiniBand NDR: "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC"
  (D. Addison (NCCL), NVIDIA/nccl-tests issue #267): 48 GB/s.
- InfiniBand HDR: 24 GB/s inter-node bus bandwidth per HDR NIC (S. Jeaugey, NVIDIA/nccl
  issue #412), and 192 GB/s all-reduce bus bandwidth between DGX A100s with 8 of them
  (D. Addison, NVIDIA/nccl issue #812, quoted in #1576): 8 x 24, the striping modelled here.
- PCIe: no published nccl-tests figure is used; the PCIe presets keep the datasheet peak.

Latency (NCCL's tuning model, src/graph/tuning.cc): per ring step (`hwLat`, LL128
protocol) about 1.9 us for NVLink, 2.5 us for PCIe and 4 us for the network; per call
(`baseLat`, ring, Simple protocol, the one large messages use) 8.4 us.

Peak dense bf16 Tensor Core FLOP/s (the datasheets quote twice these "with sparsity"):
H100 SXM and H200 SXM 989 TFLOP/s, H100 PCIe 756 TFLOP/s, A100 (SXM and PCIe) 312 TFLOP/s.
Memory per GPU (datasheets, in GB = 1e9 bytes): H100 SXM and PCIe 80 GB, H200 SXM
141 GB, A100 40 GB or 80 GB (the SXM preset here is the 80 GB part, the PCIe one 40 GB).
Less than that is usable: the CUDA context, NCCL's buffers and the allocator's
fragmentation take a few GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GB = 1e9
NCCL_BASE_LATENCY = 8.4e-6   # tuning.cc baseLat, ring / Simple


@dataclass(frozen=True)
class Link:
    """One GPU's view of a wire: `bandwidth` bytes/s one way (bus bandwidth), `latency` s
    per ring step, `base_latency` s per call, `nvls_bandwidth` the bus bandwidth of an
    in-switch all-reduce (0: the link has none).

    `per_op` holds fitted (latency, bandwidth) per op name when they were measured
    (see `tplab.cost.calibrate`); it overrides the two shared numbers for that op.
    """

    name: str
    bandwidth: float
    latency: float
    per_op: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)
    base_latency: float = 0.0
    nvls_bandwidth: float = 0.0

    def params(self, op: str) -> tuple[float, float]:
        """(alpha in s, bandwidth in bytes/s) that `op` runs at on this link."""
        return self.per_op.get(op, (self.latency, self.bandwidth))

    def with_(self, **changes) -> Link:
        """A copy with some fields changed, e.g. `link.with_(base_latency=0)`."""
        return replace(self, **changes)


@dataclass(frozen=True)
class Hardware:
    """A GPU and the links around it: `intra` inside a node, `inter` one NIC between nodes,
    `nics_per_node` of them (NCCL stripes its rings over all of them)."""

    name: str
    flops: float
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    memory: float = 80 * GB          # bytes of GPU memory
    nics_per_node: int = 8

    def link(self, group_size: int) -> Link:
        """The link a collective over `group_size` GPUs runs at: `intra` inside a node;
        beyond, the node's NICs striped (nics_per_node x inter.bandwidth, at most the
        intra-node bandwidth the rings also cross), with inter.latency per step."""
        if group_size <= self.gpus_per_node:
            return self.intra
        nics = max(1, self.nics_per_node)
        name = self.inter.name if nics == 1 else f"{nics} x {self.inter.name}"
        return Link(name, min(self.intra.bandwidth, nics * self.inter.bandwidth),
                    self.inter.latency,
                    base_latency=max(self.intra.base_latency, self.inter.base_latency))

    def nodes(self, group_size: int) -> int:
        """How many nodes a group of `group_size` consecutive GPUs spans."""
        return max(1, -(-group_size // self.gpus_per_node))

    def with_(self, **changes) -> Hardware:
        """A copy with some fields changed, e.g. `hw.with_(gpus_per_node=72)`."""
        return replace(self, **changes)


LINKS: dict[str, Link] = {
    # datasheet peaks
    "NVLink 4": Link("NVLink 4", 450 * GB, 1.9e-6),
    "NVLink 3": Link("NVLink 3", 300 * GB, 1.9e-6),
    "PCIe Gen4 x16": Link("PCIe Gen4 x16", 32 * GB, 2.5e-6, base_latency=NCCL_BASE_LATENCY),
    "PCIe Gen5 x16": Link("PCIe Gen5 x16", 64 * GB, 2.5e-6, base_latency=NCCL_BASE_LATENCY),
    "InfiniBand NDR": Link("InfiniBand NDR", 50 * GB, 4.0e-6),
    "InfiniBand HDR": Link("InfiniBand HDR", 25 * GB, 4.0e-6),
    # measured bus bandwidth, with NCCL's per-call latency (see the module doc)
    "NVLink 4 (nccl-tests)": Link("NVLink 4 (nccl-tests)", 370 * GB, 1.9e-6,
                                  base_latency=NCCL_BASE_LATENCY, nvls_bandwidth=480 * GB),
    "NVLink 3 (nccl-tests)": Link("NVLink 3 (nccl-tests)", 235 * GB, 1.9e-6,
                                  base_latency=NCCL_BASE_LATENCY),
    "InfiniBand NDR (nccl-tests)": Link("InfiniBand NDR (nccl-tests)", 48 * GB, 4.0e-6,
                                        base_latency=NCCL_BASE_LATENCY),
    "InfiniBand HDR (nccl-tests)": Link("InfiniBand HDR (nccl-tests)", 24 * GB, 4.0e-6,
                                        base_latency=NCCL_BASE_LATENCY),
}

_NV4, _NV3 = LINKS["NVLink 4 (nccl-tests)"], LINKS["NVLink 3 (nccl-tests)"]
_NDR, _HDR = LINKS["InfiniBand NDR (nccl-tests)"], LINKS["InfiniBand HDR (nccl-tests)"]

HARDWARE: dict[str, Hardware] = {
    "H100 SXM": Hardware("H100 SXM", 989e12, _NV4, _NDR),
    "H200 SXM": Hardware("H200 SXM", 989e12, _NV4, _NDR, memory=141 * GB),
    "A100 SXM": Hardware("A100 SXM", 312e12, _NV3, _HDR),
    "H100 PCIe": Hardware("H100 PCIe", 756e12, LINKS["PCIe Gen5 x16"], _NDR),
    "A100 PCIe": Hardware("A100 PCIe", 312e12, LINKS["PCIe Gen4 x16"], _HDR,
                          memory=40 * GB),
}
"""Presets by name: measured bus bandwidth where nccl-tests results are published, 8 NICs
per node. "this machine" comes from `calibrate(lab).hardware`."""

GPU_MEMORY: dict[str, float] = {"A100 40 GB": 40 * GB, "A100 / H100 80 GB": 80 * GB,
                                "H200 141 GB": 141 * GB}
"""The memory sizes the cost explorer draws as lines (datasheets)."""
