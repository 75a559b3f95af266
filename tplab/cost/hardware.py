"""Links and machines: the numbers the alpha-beta model runs on.

A `Link` is what one GPU sees of the wire its collectives use: `bandwidth` in bytes/s in
one direction (what nccl-tests calls bus bandwidth at its peak) and `latency` (alpha) in
seconds per step of a ring. A `Hardware` is a GPU (its peak dense bf16 FLOP/s) in a node:
collectives among up to `gpus_per_node` GPUs use `intra`, larger groups cross nodes and
use `inter`.

Sources (datasheet peaks; measured bus bandwidth is usually 70-90% of them):

- NVLink 4, H100 SXM and H200 SXM: 900 GB/s bidirectional per GPU, so 450 GB/s each way
  (NVIDIA H100 Tensor Core GPU datasheet; NVIDIA H200 Tensor Core GPU datasheet).
- NVLink 3, A100 SXM: 600 GB/s bidirectional, 300 GB/s each way (NVIDIA A100 datasheet).
- PCIe Gen4 x16: 64 GB/s bidirectional, 32 GB/s each way (A100 PCIe datasheet; PCI-SIG:
  16 GT/s per lane). PCIe Gen5 x16: 128 GB/s bidirectional, 64 GB/s each way (H100 PCIe
  datasheet; PCI-SIG: 32 GT/s per lane).
- InfiniBand NDR: 400 Gb/s = 50 GB/s per HCA, one ConnectX-7 per GPU in a DGX H100/H200
  (NVIDIA DGX H100 user guide). InfiniBand HDR: 200 Gb/s = 25 GB/s per HCA, one ConnectX-6
  per GPU in a DGX A100.
- Peak dense bf16 Tensor Core FLOP/s (the datasheets quote twice these "with sparsity"):
  H100 SXM and H200 SXM 989 TFLOP/s, H100 PCIe 756 TFLOP/s, A100 (SXM and PCIe) 312 TFLOP/s.
- Memory per GPU (datasheets, in GB = 1e9 bytes): H100 SXM and PCIe 80 GB, H200 SXM
  141 GB, A100 40 GB or 80 GB (the SXM preset here is the 80 GB part, the PCIe one 40 GB).
  Less than that is usable: the CUDA context, NCCL's buffers and the allocator's
  fragmentation take a few GB.
- Latency per ring step: NCCL's own tuning model (src/graph/tuning.cc, `hwLat`, LL128
  protocol) uses about 1.9 us for NVLink, 2.5 us for PCIe and 4 us for the network.

A ring that leaves the node is modelled at the speed of its slowest hop, the GPU's own
NIC. NCCL runs several rings at once over all of a node's NICs, which wins back part of
the gap for large messages; the model keeps the simple bound, as the Ultra-Scale Playbook's
discussion of TP across nodes does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GB = 1e9


@dataclass(frozen=True)
class Link:
    """One GPU's view of a wire: `bandwidth` bytes/s one way, `latency` s per ring step.

    `per_op` holds fitted (latency, bandwidth) per op name when they were measured
    (see `tplab.cost.calibrate`); it overrides the two shared numbers for that op.
    """

    name: str
    bandwidth: float
    latency: float
    per_op: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)

    def params(self, op: str) -> tuple[float, float]:
        """(alpha in s, bandwidth in bytes/s) that `op` runs at on this link."""
        return self.per_op.get(op, (self.latency, self.bandwidth))


@dataclass(frozen=True)
class Hardware:
    """A GPU and the links around it: `intra` inside a node, `inter` between nodes."""

    name: str
    flops: float
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    memory: float = 80 * GB          # bytes of GPU memory

    def link(self, group_size: int) -> Link:
        """The link a collective over `group_size` GPUs is limited by."""
        return self.intra if group_size <= self.gpus_per_node else self.inter

    def with_(self, **changes) -> Hardware:
        """A copy with some fields changed, e.g. `hw.with_(gpus_per_node=72)`."""
        return replace(self, **changes)


LINKS: dict[str, Link] = {
    "NVLink 4": Link("NVLink 4", 450 * GB, 1.9e-6),
    "NVLink 3": Link("NVLink 3", 300 * GB, 1.9e-6),
    "PCIe Gen4 x16": Link("PCIe Gen4 x16", 32 * GB, 2.5e-6),
    "PCIe Gen5 x16": Link("PCIe Gen5 x16", 64 * GB, 2.5e-6),
    "InfiniBand NDR": Link("InfiniBand NDR", 50 * GB, 4.0e-6),
    "InfiniBand HDR": Link("InfiniBand HDR", 25 * GB, 4.0e-6),
}

HARDWARE: dict[str, Hardware] = {
    "H100 SXM": Hardware("H100 SXM", 989e12, LINKS["NVLink 4"], LINKS["InfiniBand NDR"]),
    "H200 SXM": Hardware("H200 SXM", 989e12, LINKS["NVLink 4"], LINKS["InfiniBand NDR"],
                         memory=141 * GB),
    "A100 SXM": Hardware("A100 SXM", 312e12, LINKS["NVLink 3"], LINKS["InfiniBand HDR"]),
    "H100 PCIe": Hardware("H100 PCIe", 756e12, LINKS["PCIe Gen5 x16"], LINKS["InfiniBand NDR"]),
    "A100 PCIe": Hardware("A100 PCIe", 312e12, LINKS["PCIe Gen4 x16"], LINKS["InfiniBand HDR"],
                          memory=40 * GB),
}
"""Presets by name. "this machine" comes from `calibrate(lab).hardware`."""

GPU_MEMORY: dict[str, float] = {"A100 40 GB": 40 * GB, "A100 / H100 80 GB": 80 * GB,
                                "H200 141 GB": 141 * GB}
"""The memory sizes the cost explorer draws as lines (datasheets)."""
