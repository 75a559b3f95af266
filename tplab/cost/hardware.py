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
at nics_per_node x inter.bandwidth: the NICs bind (nccl-tests #319: 384-396 GB/s across
DGX H100 nodes, above a ring's 370 inside one), up to the NVLink datasheet peak
(`Link.peak_bandwidth`; `Hardware.link`). Its latency is NCCL's: the steps inside a node
at intra.latency, the steps between nodes at inter.latency (src/graph/tuning.cc,
`ncclTopoTuneModel`).

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
- NVLink 3 (A100): about 230 GB/s (below).
- InfiniBand NDR: "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC"
  (D. Addison (NCCL), NVIDIA/nccl-tests issue #267): 48 GB/s.
- InfiniBand HDR: 24 GB/s inter-node bus bandwidth per HDR NIC (S. Jeaugey, NVIDIA/nccl
  issue #412), and 192 GB/s all-reduce bus bandwidth between DGX A100s with 8 of them
  (D. Addison, NVIDIA/nccl issue #812, quoted in #1576): 8 x 24, the striping modelled here.
- PCIe: no published nccl-tests figure is used; the PCIe presets keep the datasheet peak.

Latency: NCCL's tuning model (`tplab.cost.nccl`, NCCL 2.21.5's src/graph/tuning.cc). A
link's `kind` ("nvlink", "pci", "net") says which row of NCCL's latency tables it takes;
its `latency` and `base_latency` are the ring's Simple-protocol values there (per step
`hwLat`: 3.4 us NVLink, 5.7 us PCIe, 14 us network; per call `baseLat` 8.4 us), and the
other protocols and algorithms take NCCL's own values scaled by the same ratio, so that
`link.with_(latency=2 * link.latency)` doubles every latency. A link with no `kind` (a
calibrated one, or one made by hand) is a plain alpha-beta link: one protocol, its own
numbers.

Cross-node all-to-all gets ONE NIC per GPU, not the striped rings: NCCL's all-to-all is
point-to-point and cannot aggregate NICs ("CX-7 NICs at NDR rate should achieve up to
48-49GB/s per NIC", D. Addison, nccl-tests issue #267), about 48 GB/s per GPU on NDR.

A100: NCCL's tuning model capped an A100's bus bandwidth at 235 GB/s until 2.18.1
(`if (compCap80) busBw = std::min(busBw, 235.0f)`, gone from 2.18.1 on); the preset
takes 230 GB/s, the ring bus bandwidth DGX A100 nodes measure (the cap was set from such
measurements; not re-measured here: no GPU).

Peak dense bf16 Tensor Core FLOP/s (the datasheets quote twice these "with sparsity"):
H100 SXM and H200 SXM 989 TFLOP/s, H100 PCIe 756 TFLOP/s, A100 (SXM and PCIe) 312 TFLOP/s.
Memory bandwidth (datasheets): H100 SXM 3.35 TB/s, H200 4.8 TB/s, H100 PCIe 2.0 TB/s,
A100 SXM 80 GB 2.039 TB/s, A100 PCIe 40 GB 1.555 TB/s; streaming multiprocessors: H100 SXM
and H200 132, H100 PCIe 114, A100 108 (the GEMM model, `tplab.cost.kernels`, uses the first).
Memory-bound work (element-wise kernels, the GEMM memory roofline, the loss, the optimizer
step) runs at `achievable_bandwidth`: the datasheet's `memory_bandwidth` x
`memory_efficiency`, by default `HBM_EFFICIENCY` on every card (below).

Memory per GPU in bytes as nvidia-smi reports it, not the datasheet's GB: H100 80 GB
81,559 MiB, H200 143,771 MiB, A100 80 GB 81,920 MiB, A100 40 GB 40,960 MiB. Not all of it
holds tensors: `memory_reserve` (default 2 GiB, an assumption: the CUDA context, cuBLAS
workspaces, NCCL's buffers, allocator fragmentation; set it to what your runs show) is
kept back, and `usable_memory` is what the model fits parameters and activations into.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tplab.cost.validate import check_bool, check_choice, check_int, check_number, check_type

GB = 1e9
MiB, GiB = 2**20, 2**30
HBM_EFFICIENCY = 0.896
"""The fraction of the datasheet memory bandwidth a streaming copy reaches: 4.30 TB/s of
4.8 on one H200 (benchmarks/results/gpu-2026-12-04.json: torch's device-to-device copy of
4 GiB, read + write, 0.890-0.896 over three runs). Every preset takes it: no HBM card
reaches its datasheet in a copy, and the others fall as far or further (Azure's
AI-benchmarking-guide, BabelStream's CUDA Copy: A100-SXM4-80GB 1.61 TB/s of 2.039, 0.79;
H100 80GB HBM3 2.90 of 3.35, 0.87; H200 4.01 of 4.8, 0.84; NVIDIA developer forum
"Trouble to Reach Peak Bandwidth of A100": an A100 80GB SXM read kernel at 1.80 TB/s, 88%
by Nsight Compute). docs/VALIDATION.md, round thirteen, reports it held out."""
KINDS = ("", "nvlink", "pci", "net")
ARCHS = ("volta", "ampere", "hopper")
CPUS = ("intel", "amd")


@dataclass(frozen=True)
class Link:
    """One GPU's view of a wire: `bandwidth` bytes/s one way (bus bandwidth, the Simple
    protocol's at large sizes), `latency` s per ring step and `base_latency` s per call
    (NCCL's ring/Simple values for a `kind` of link; see the module doc), `nvls_bandwidth`
    the peak bus bandwidth of an in-switch all-reduce (0: the link has none) and
    `nvls_ramp` the message size at which NVLS reaches half of it beyond its latency.

    `per_op` holds fitted (latency, bandwidth) per op name when they were measured
    (see `tplab.cost.calibrate`); it overrides the two shared numbers for that op.
    """

    name: str
    bandwidth: float
    latency: float
    per_op: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)
    base_latency: float = 0.0
    nvls_bandwidth: float = 0.0
    kind: str = ""
    nvls_ramp: float = 0.0
    peak_bandwidth: float = 0.0      # the datasheet's one-way peak (0: `bandwidth`)

    def __post_init__(self):
        check_type("name", self.name, str, "a string")
        check_number("bandwidth", self.bandwidth, strict=True)
        check_number("latency", self.latency)
        check_number("base_latency", self.base_latency)
        check_number("nvls_bandwidth", self.nvls_bandwidth)
        check_number("nvls_ramp", self.nvls_ramp)
        check_number("peak_bandwidth", self.peak_bandwidth)
        check_choice("kind", self.kind, KINDS)
        check_type("per_op", self.per_op, dict, "a dict {op: (latency, bandwidth)}")

    def params(self, op: str) -> tuple[float, float]:
        """(alpha in s, bandwidth in bytes/s) that `op` runs at on this link."""
        return self.per_op.get(op, (self.latency, self.bandwidth))

    def with_(self, **changes) -> Link:
        """A copy with some fields changed, e.g. `link.with_(base_latency=0)`."""
        return replace(self, **changes)


@dataclass(frozen=True)
class Hardware:
    """A GPU and the links around it: `intra` inside a node, `inter` one NIC between nodes,
    `nics_per_node` of them (NCCL stripes its rings over all of them). `arch` and `cpu`
    pick NCCL's tables (its LL bandwidth caps, its network overhead); `sms` and
    `memory_bandwidth` (the datasheet's; memory-bound work runs at `achievable_bandwidth`,
    x `memory_efficiency`) feed the GEMM model; `memory` is bytes (nvidia-smi's), of which
    `memory_reserve` is kept back; `collnet`: the fabric reduces in the switches (SHARP),
    which lets NCCL use its CollNet algorithms (no preset has it)."""

    name: str
    flops: float
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    memory: float = 81559 * MiB      # bytes of GPU memory (nvidia-smi)
    nics_per_node: int = 8
    arch: str = "hopper"
    cpu: str = "intel"
    sms: int = 132
    memory_bandwidth: float = 3.35e12
    memory_reserve: float = 2 * GiB
    collnet: bool = False
    fp8_flops: float = 0.0           # peak dense fp8 FLOP/s (0: no fp8 Tensor Cores)
    matmul_efficiency: float = 0.80  # a large bf16 GEMM's measured rate / peak (MAMF)
    fp8_matmul_efficiency: float = 0.70
    attention_efficiency: float = 0.35   # flash attention's rate / peak, fwd + bwd
    fp8_any_layout: bool = False     # fp8 GEMMs take any operand layout (Blackwell)
    sustained: float = 1.0           # Tensor Core rate held at the power cap / burst (MSMF)
    memory_efficiency: float = HBM_EFFICIENCY   # a copy's rate / datasheet bandwidth

    def __post_init__(self):
        check_type("name", self.name, str, "a string")
        check_number("flops", self.flops, strict=True)
        check_type("intra", self.intra, Link, "a tplab.cost.Link")
        check_type("inter", self.inter, Link, "a tplab.cost.Link")
        check_int("gpus_per_node", self.gpus_per_node)
        check_number("memory", self.memory, strict=True)
        check_int("nics_per_node", self.nics_per_node)
        check_choice("arch", self.arch, ARCHS)
        check_choice("cpu", self.cpu, CPUS)
        check_int("sms", self.sms)
        check_number("memory_bandwidth", self.memory_bandwidth, strict=True)
        check_number("memory_reserve", self.memory_reserve, maximum=self.memory)
        check_bool("collnet", self.collnet)
        check_number("fp8_flops", self.fp8_flops)
        check_number("matmul_efficiency", self.matmul_efficiency, strict=True, maximum=1.0)
        check_number("fp8_matmul_efficiency", self.fp8_matmul_efficiency, strict=True,
                     maximum=1.0)
        check_number("attention_efficiency", self.attention_efficiency, strict=True,
                     maximum=1.0)
        check_bool("fp8_any_layout", self.fp8_any_layout)
        check_number("sustained", self.sustained, strict=True, maximum=1.0)
        check_number("memory_efficiency", self.memory_efficiency, strict=True, maximum=1.0)

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes/s memory-bound kernels run at: `memory_bandwidth` x `memory_efficiency`."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def usable_memory(self) -> float:
        """Bytes the model fits tensors into: `memory` - `memory_reserve`."""
        return self.memory - self.memory_reserve

    def link(self, group_size: int, op: str = "all_reduce") -> Link:
        """The link a collective over `group_size` GPUs runs at: `intra` inside a node;
        beyond, the node's NICs striped (nics_per_node x inter.bandwidth: the NICs bind, as
        nccl-tests #319 measured 384-396 GB/s bus bandwidth across DGX H100 nodes, above
        the 370 of a ring inside one; at most the intra link's datasheet peak,
        `peak_bandwidth`), with inter's latencies. An all-to-all
        across nodes gets one GPU's share of the NICs: NCCL cannot aggregate them for
        point-to-point traffic (nccl-tests #267)."""
        check_int("group_size", group_size)
        if group_size <= self.gpus_per_node:
            return self.intra
        nics = max(1, self.nics_per_node)
        if op == "all_to_all":
            share = self.inter.bandwidth * nics / self.gpus_per_node
            return self.inter.with_(name=f"{self.inter.name}, one NIC per GPU",
                                    bandwidth=min(share, self.inter.bandwidth))
        name = self.inter.name if nics == 1 else f"{nics} x {self.inter.name}"
        cap = self.intra.peak_bandwidth or self.intra.bandwidth
        return self.inter.with_(name=name, per_op={},
                                bandwidth=min(cap, nics * self.inter.bandwidth),
                                base_latency=max(self.intra.base_latency,
                                                 self.inter.base_latency))

    def nodes(self, group_size: int) -> int:
        """How many nodes a group of `group_size` consecutive GPUs spans."""
        check_int("group_size", group_size)
        return max(1, -(-group_size // self.gpus_per_node))

    def with_(self, **changes) -> Hardware:
        """A copy with some fields changed, e.g. `hw.with_(gpus_per_node=72)`."""
        return replace(self, **changes)


# NCCL 2.21.5 src/graph/tuning.cc, ring / Simple: hwLat per step and baseLat per call
NCCL_BASE_LATENCY = 8.4e-6
SIMPLE_STEP = {"nvlink": 3.4e-6, "pci": 5.7e-6, "net": 14.0e-6}
NVLS_RAMP = 19.5e6
"""Half-bandwidth size of NVLS beyond its 25 us latency: with it, the model gives the
algorithm bandwidth of about 250 GB/s at 256 MiB on 8 H100 that nccl-tests #212 reports
(busbw 437 of the 480 GB/s peak S. Jeaugey quotes there: "256M is too small to reach peak
bandwidth"). A fit to one published point, stated as such."""

LINKS: dict[str, Link] = {
    # datasheet peaks, plain alpha-beta (no kind): the Simple ring's per-step latency
    "NVLink 4": Link("NVLink 4", 450 * GB, SIMPLE_STEP["nvlink"]),
    "NVLink 3": Link("NVLink 3", 300 * GB, SIMPLE_STEP["nvlink"]),
    "PCIe Gen4 x16": Link("PCIe Gen4 x16", 32 * GB, SIMPLE_STEP["pci"], kind="pci",
                          base_latency=NCCL_BASE_LATENCY),
    "PCIe Gen5 x16": Link("PCIe Gen5 x16", 64 * GB, SIMPLE_STEP["pci"], kind="pci",
                          base_latency=NCCL_BASE_LATENCY),
    "InfiniBand NDR": Link("InfiniBand NDR", 50 * GB, SIMPLE_STEP["net"]),
    "InfiniBand HDR": Link("InfiniBand HDR", 25 * GB, SIMPLE_STEP["net"]),
    # measured bus bandwidth, with NCCL's latency tables (see the module doc)
    "NVLink 4 (nccl-tests)": Link("NVLink 4 (nccl-tests)", 370 * GB, SIMPLE_STEP["nvlink"],
                                  base_latency=NCCL_BASE_LATENCY, nvls_bandwidth=480 * GB,
                                  kind="nvlink", nvls_ramp=NVLS_RAMP,
                                  peak_bandwidth=450 * GB),
    "NVLink 3 (nccl-tests)": Link("NVLink 3 (nccl-tests)", 230 * GB, SIMPLE_STEP["nvlink"],
                                  base_latency=NCCL_BASE_LATENCY, kind="nvlink",
                                  peak_bandwidth=300 * GB),
    "InfiniBand NDR (nccl-tests)": Link("InfiniBand NDR (nccl-tests)", 48 * GB,
                                        SIMPLE_STEP["net"], base_latency=NCCL_BASE_LATENCY,
                                        kind="net"),
    "InfiniBand HDR (nccl-tests)": Link("InfiniBand HDR (nccl-tests)", 24 * GB,
                                        SIMPLE_STEP["net"], base_latency=NCCL_BASE_LATENCY,
                                        kind="net"),
}

_NV4, _NV3 = LINKS["NVLink 4 (nccl-tests)"], LINKS["NVLink 3 (nccl-tests)"]
_NDR, _HDR = LINKS["InfiniBand NDR (nccl-tests)"], LINKS["InfiniBand HDR (nccl-tests)"]

# Blackwell's NVLink 5: 1,800 GB/s bidirectional per GPU, 900 each way (NVIDIA DGX B200 and
# GB200 NVL72 datasheets). No nccl-tests figure is published for it that tplab could cite:
# the ring and NVLS bus bandwidths take NVLink 4's measured fractions of its peak
# (370/450 and 480/450), an assumption stated as such.
_NV5 = _NV4.with_(name="NVLink 5 (NVLink 4's measured fractions)",
                  bandwidth=900 * GB * 370 / 450, nvls_bandwidth=900 * GB * 480 / 450,
                  peak_bandwidth=900 * GB)

# Matmul efficiency: the Maximum Achievable Matmul FLOPS over the datasheet peak measured by
# S. Bekman's mamf-finder (stas00/ml-engineering, compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS comparison table"): bf16 A100 SXM 271.2/312, H100 SXM 794.5/989
# ("H200 is the same"), B200 1745/2250, GB200 1822/2500; fp8 H100 1402.6/1979, H200
# 1453.4/1979, B200 3432.5/4500, GB200 3615.6/5000.
# Attention efficiency: FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s
# on A100" (Dao 2023, abstract; its backward is the slower part: 0.5 on A100) and "only 35%
# utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3, abstract): 0.35 on
# Hopper, and on Blackwell, where no published figure is used (an assumption).
# Sustained rate (`sustained`): MAMF is a boost-clock burst; a dense training step keeps
# the SMs busy, draws the card's power limit and runs at the clock that settles there.
# mamf-finder (stas00/ml-engineering) measures that as MSMF ("Maximum Sustainable Matmul
# FLOPS"; compute/accelerator/README.md: "for training-throughput reasoning use MSMF").
# Hopper (H100 SXM, H200 SXM; the 500 W H100 below from it): 698.6 bf16 TFLOP/s, the MSMF
# mean of all 8 H200s of a node computing at once, 5 rounds (n=40), SM clock 1405-1527 MHz
# (compute/accelerator/benchmarks/README.md on branch fast-mamf, 082816f, "What we
# measured: alone vs all-8 concurrent"; one GPU alone 702.9; the branch's table, siblings
# idle: 708.5 at 8192x8448x20480, ~693 W, 1465 MHz). Its MSMF then left out any shape
# clocked above the saturated shapes' clock (mamf-finder.py's --msmf_clock_ratio): fat
# shapes at the power cap, as a training step's GEMMs are (M = 8192 or more tokens, N and K
# in the thousands). The H100 SXM (the same GH100 die at the same 700 W, five HBM3 stacks
# drawing less of it than the H200's six) takes it as its own: for it likely a lower bound.
# Checked on fp8 in absolute terms: the preset's fp8 MAMF 1453.4 x 698.6 / 794.5 = 1278
# against the branch's fp8 MSMF 1288.7 (8448x8192x16384, ~693 W, 1374 MHz, siblings idle).
# Not the 755 of the later protocol (master's later benchmarks/README.md: "a node MSMF of
# 755"; the 8-GPU MSMF clock 1850-1938 MHz, GPU0 alone 745 at 1536x2816x6144): it says
# "Power doesn't enter the definition" and walks K down because "a shorter K lets the same
# (M,N) hold a higher clock" (2816x1536: 727 at K=20480, 749 at K=6144, 1879 MHz), so it
# selects a one-wave, short-K shape no training GEMM is. (Why that shape holds 1879 MHz at
# 685 W, an inference: each timed matmul there is ~70 us beside an untimed 256 MiB L2 flush
# of about as long.) One H200 alone (docs/VALIDATION.md, rounds thirteen to fifteen;
# benchmarks/gpu_rates.py, gpu_held.py): back-to-back 8192^3 GEMMs held 8 s, 667.3 TFLOP/s
# (HOPPER_HELD; 659.9 at a median 1470 MHz in a later run); four Llama-3 8B layers held
# 24 s sat at a median 1560 MHz, 692 W, which at that GEMM loop's rate per MHz is 700.3
# (HOPPER_MIX: a conversion that assumes the GEMMs ran at the mix's median clock).
# B200: 1439 of its MAMF 1737 (master's node figure, all 8 computing; its n=40 study held
# 1437.5 at 1368-1527 MHz), taken for GB200 too. A100 SXM takes the A100
# PCIe's measured 258 / 285 (no SXM MSMF is published: an assumption, stated).
# One factor per preset, on every Tensor Core rate a training step uses (bf16 and fp8 GEMMs,
# flash attention): a clock, not a kernel.
# fp8 layouts: on Hopper cuBLASLt's fp8 kernels need "A transposed and B non-transposed (the
# TN format)" (cuBLAS docs, cublasLtMatmul), so a quantised tensor used by two GEMMs is
# also written transposed (Transformer Engine docs, "Performance considerations: handling
# transposes"); Blackwell "supports any GEMM layout for FP8" (TransformerEngine #2514).
H100_NVL_BF16 = 835e12   # H100 NVL datasheet: 1,671 bf16 TFLOP/s with sparsity, 835 dense
HOPPER_MSMF = 698.6      # bf16 TFLOP/s: mamf-finder's MSMF, 8 H200s computing at once
HOPPER_NODE_MSMF = 755.0  # the later node MSMF: a 1-wave short-K shape at 1850+ MHz (not kept)
HOPPER_HELD = 667.3      # one H200 alone, 8192^3 GEMMs held at 700 W (not the presets')
HOPPER_MIX = 700.3       # one H200 alone, a training mix held at 700 W, per-MHz converted
HOPPER_SUSTAINED = HOPPER_MSMF / 794.5
HARDWARE: dict[str, Hardware] = {
    "H100 SXM": Hardware("H100 SXM", 989e12, _NV4, _NDR, fp8_flops=1979e12,
                         matmul_efficiency=794.5 / 989, fp8_matmul_efficiency=1402.6 / 1979,
                         sustained=HOPPER_SUSTAINED),
    "H200 SXM": Hardware("H200 SXM", 989e12, _NV4, _NDR, memory=143771 * MiB,
                         memory_bandwidth=4.8e12, fp8_flops=1979e12,
                         matmul_efficiency=794.5 / 989, fp8_matmul_efficiency=1453.4 / 1979,
                         sustained=HOPPER_SUSTAINED),
    "A100 SXM": Hardware("A100 SXM", 312e12, _NV3, _HDR, memory=81920 * MiB, arch="ampere",
                         cpu="amd", sms=108, memory_bandwidth=2.039e12,
                         matmul_efficiency=271.2 / 312, attention_efficiency=0.5,
                         sustained=258 / 285),
    # Meta's Grand Teton H100 (torchtitan docs/performance.md): 96 GB HBM2e at 2.4 TB/s,
    # 400 Gb/s per GPU, a 500 W power limit; "HBM2e based lower TDP SXM H100 (95GB) [...]
    # the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact
    # value". The preset keeps the SXM's peak (the figure torchtitan's MFU divides by) and
    # holds its Tensor Cores at the lower end of that bracket, the H100 NVL's: dense bf16
    # 835 of the SXM's 989 TFLOP/s (H100 NVL and H100 SXM datasheets), times the SXM's
    # sustained fraction. The lower end because the cap (500 W) is nearer the NVL's 400 W
    # than the SXM's 700 W; no MSMF is published for this GPU (an assumption, stated).
    "H100 96GB (500 W)": Hardware("H100 96GB (500 W)", 989e12, _NV4, _NDR, memory=96e9,
                                  memory_bandwidth=2.4e12, fp8_flops=1979e12,
                                  matmul_efficiency=794.5 / 989,
                                  fp8_matmul_efficiency=1402.6 / 1979,
                                  sustained=HOPPER_SUSTAINED * H100_NVL_BF16 / 989e12),
    # DGX B200: 8 B200 (2.25 PFLOP/s dense bf16, 4.5 fp8, as NVIDIA's dgxc-benchmarking
    # llama3.1 README tabulates them), "180 GB" HBM3e at 8 TB/s, 148 SMs, 8 ConnectX-7 NDR.
    # NCCL's tables for it are taken as Hopper's (tplab models NCCL 2.21.5). Its memory is
    # what CUDA reports, 178.35 GiB ("Total Global Memory: 178.35 GB" from a device query
    # in pytorch/ao#4002): the datasheet's "180 GB" read as 180e9 bytes is 167.6 GiB, 11
    # GiB short of the card (the other presets hold nvidia-smi's MiB).
    # GB200 likewise: torch's "total capacity of 184.31 GiB" (vllm-project/vllm#43951 and
    # #52511, OOM messages on 4 x GB200) where "186 GB" as 186e9 bytes is 173.2 GiB.
    "B200": Hardware("B200", 2250e12, _NV5, _NDR, memory=178.35 * GiB, memory_bandwidth=8e12,
                     sms=148, fp8_flops=4500e12, matmul_efficiency=1745 / 2250,
                     fp8_matmul_efficiency=3432.5 / 4500, fp8_any_layout=True,
                     sustained=1439 / 1737),
    # GB200 NVL72: 72 GPUs in one NVLink domain, one ConnectX-7 per GPU; 2.45 PFLOP/s bf16
    # (dgxc-benchmarking's figure, which its MFU uses), 186 GB HBM3e at 8 TB/s.
    "GB200 NVL72": Hardware("GB200 NVL72", 2450e12, _NV5, _NDR, gpus_per_node=72,
                            nics_per_node=72, memory=184.31 * GiB, memory_bandwidth=8e12,
                            sms=148,
                            fp8_flops=4900e12, matmul_efficiency=1822 / 2500,
                            fp8_matmul_efficiency=3615.6 / 5000, fp8_any_layout=True,
                            sustained=1439 / 1737),
    "H100 PCIe": Hardware("H100 PCIe", 756e12, LINKS["PCIe Gen5 x16"], _NDR, sms=114,
                          memory_bandwidth=2.0e12),
    "A100 PCIe": Hardware("A100 PCIe", 312e12, LINKS["PCIe Gen4 x16"], _HDR,
                          memory=40960 * MiB, arch="ampere", cpu="amd", sms=108,
                          memory_bandwidth=1.555e12),
}
"""Presets by name: measured bus bandwidth where nccl-tests results are published, 8 NICs
per node; DGX H100/H200 have Intel CPUs, DGX A100 AMD ones (NCCL's network overhead).
"this machine" comes from `calibrate(lab).hardware`."""

GPU_MEMORY: dict[str, float] = {"A100 40 GB": 40960 * MiB, "A100 / H100 80 GB": 81920 * MiB,
                                "H100 (nvidia-smi)": 81559 * MiB,
                                "H200 141 GB": 143771 * MiB}
"""The memory sizes the cost explorer draws as lines (nvidia-smi's MiB, in bytes)."""
