"""A transformer block under Megatron tensor parallelism, on paper: its bytes and FLOPs.

Communication per block, for b sequences of s tokens, hidden size h, d bytes per element,
so that every message is T = b s h d bytes (Shoeybi et al. 2019, "Megatron-LM", section 3;
Korthikanti et al. 2022, "Reducing activation recomputation in large transformer models",
section 4.2.2; the Ultra-Scale Playbook, "Tensor Parallelism" and "Sequence Parallelism"):

| plan | forward | backward |
|---|---|---|
| TP | 2 all-reduce (g after attention and MLP) | 2 all-reduce (f at their inputs) |
| TP + SP | 2 all-gather + 2 reduce-scatter | 2 all-gather + 2 reduce-scatter |

An all-reduce is a reduce-scatter followed by an all-gather, so both plans move the same
bytes; sequence parallelism saves activation memory, not bandwidth (Korthikanti et al.
2022), though its twice as many calls pay NCCL's per-call latency twice. Under SP Megatron-LM
keeps a region's input as its 1/t shard and all-gathers it again in backward
(`sp_saves="shard"`: 10 collectives, 25% more bytes); DTensor keeps it gathered.

Overlap (`overlap=`, `OVERLAPS`): each record has a `role` in its region, and each overlap
mode names the GEMM a role can hide behind: Megatron-LM's async backward puts the input
gradient's all-reduce (or reduce-scatter) behind the weight-gradient GEMM; PyTorch's async TP
pipelines every SP all-gather and reduce-scatter with its matmul. Rows carry `tp_comm_s`
(all of it) and `exposed_comm_s` (what stays on the critical path).

Compute: forward FLOPs of one block, counting matmuls (2 FLOPs per multiply-add), are
2bs h (h + 2 h_kv) for q, k, v, 2bs h^2 for the output projection, 4 b s^2 h for the
scores and their product with v, and 2bs h f (3 matrices with a gated MLP such as SwiGLU,
2 without). With f = 4h and no grouped-query attention this is 24 b s h^2 + 4 b s^2 h
(Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters
using Megatron-LM", section 5.1). The backward pass costs twice the forward.

Where TP becomes communication-bound: for the MLP alone the ratio of TP communication to
compute time (bytes terms only, ring all-reduce, N-way TP, peak C FLOP/s, bandwidth B) is
d (N-1) C / (3 f B): it does not depend on the batch, grows with N and shrinks with the
feed-forward size f. The JAX scaling book ("How to Scale Your Model") has the forward pass:
model parallelism is comms-bound once N exceeds about f / (C/B), with C/B about 2200 for an
H100 over NVLink in its GPU chapter (its TPU training chapter uses 2550). The
form here adds x 3/2 for the backward pass, x m/2 for a gated MLP's third matrix, and keeps
the all-reduce's factor 2 (N-1)/N; C is `mfu` x peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tplab.cost.hardware import Hardware


@dataclass(frozen=True)
class BlockShape:
    """The dimensions of a transformer block and the micro-batch it processes."""

    hidden: int
    heads: int
    ffn: int | None = None           # default 4 * hidden
    kv_heads: int | None = None      # default heads (no grouped-query attention)
    gated: bool = False              # SwiGLU-style MLP: 3 matrices instead of 2
    seq: int = 4096
    batch: int = 1                   # sequences per micro-batch
    layers: int = 1
    dtype_bytes: int = 2             # bf16
    name: str = ""
    vocab: int = 0                   # embedding and lm head rows (0: blocks only)

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def activation_bytes(self) -> int:
        """T = b s h d: the size of every TP message of the block."""
        return self.tokens * self.hidden * self.dtype_bytes

    def with_(self, **changes) -> BlockShape:
        return replace(self, **changes)


MODELS: dict[str, BlockShape] = {
    # Llama 3 8B and 70B: "The Llama 3 Herd of Models" (2024), table 3.
    "Llama-3 8B": BlockShape(hidden=4096, heads=32, kv_heads=8, ffn=14336, gated=True,
                             layers=32, vocab=128256, name="Llama-3 8B"),
    "Llama-3 70B": BlockShape(hidden=8192, heads=64, kv_heads=8, ffn=28672, gated=True,
                              layers=80, vocab=128256, name="Llama-3 70B"),
    # GPT-3 style shape with f = 4h (Brown et al. 2020, table 2.1: 6.7B and 175B).
    "GPT-3 6.7B": BlockShape(hidden=4096, heads=32, layers=32, seq=2048, vocab=50257,
                             name="GPT-3 6.7B"),
    "GPT-3 175B": BlockShape(hidden=12288, heads=96, layers=96, seq=2048, vocab=50257,
                             name="GPT-3 175B"),
}


SUBLAYERS = ("attention", "mlp")


def scaled(shape: BlockShape, hidden: int, **changes) -> BlockShape:
    """`shape` at another hidden size: heads of the same width, the same ffn / hidden ratio,
    the same number of kv heads (at most the heads). Other fields may change too."""
    heads = max(1, hidden // (shape.hidden // shape.heads))
    return shape.with_(hidden=hidden, heads=heads, kv_heads=min(shape.kv_heads or heads, heads),
                       ffn=round(shape.ffn_size * hidden / shape.hidden), **changes)


def block_flops(shape: BlockShape, sublayers: tuple[str, ...] = SUBLAYERS) -> int:
    """Forward FLOPs of one block on one micro-batch, over all TP ranks together."""
    h, t = shape.hidden, shape.tokens
    kv_dim = (shape.kv_heads or shape.heads) * (h // shape.heads)
    qkv = 2 * t * h * (h + 2 * kv_dim)
    out = 2 * t * h * h
    scores = 4 * shape.batch * shape.seq**2 * h
    mlp = 2 * t * h * shape.ffn_size * (3 if shape.gated else 2)
    return ("attention" in sublayers) * (qkv + out + scores) + ("mlp" in sublayers) * mlp


ROLES = ("fwd_in", "fwd_out", "bwd_out", "bwd_in", "regather")
"""Where a TP record sits in its region (its "role"): entering it in forward (SP's
all-gather), leaving it in forward (g: all-reduce, or SP's reduce-scatter), the
conjugate of leaving it in backward (SP's all-gather of dy), the conjugate of entering it
in backward (f: all-reduce, or SP's reduce-scatter of dx), and Megatron's second
all-gather of a sequence-sharded input in backward (`sp_saves="shard"`)."""

OVERLAPS: dict[str, dict[str, str]] = {
    "none": {},
    # Megatron-LM, LinearWithGradAccumulationAndAsyncCommunication.backward: the input
    # gradient's all-reduce (or reduce-scatter under SP) is issued async before the weight
    # gradient GEMM and waited on after it; the input's re-gather under SP is issued
    # before the input-gradient GEMM (megatron/core/tensor_parallel/layers.py)
    "megatron": {"bwd_in": "col_wgrad", "regather": "col_dgrad"},
    # PyTorch async TP (torch.distributed._symmetric_memory.fused_all_gather_matmul and
    # fused_matmul_reduce_scatter; torch._inductor's micro-pipeline TP): every SP
    # all-gather is pipelined with the matmul it feeds, every reduce-scatter with the
    # matmul that makes its input, in both passes
    "async_tp": {"fwd_in": "col_fwd", "fwd_out": "row_fwd", "bwd_out": "row_dgrad",
                 "bwd_in": "col_dgrad", "regather": "col_wgrad"},
}
"""For each `overlap=`, the GEMM of the region that each role of record can hide behind."""

SP_SAVES = ("gathered", "shard")

MFU = 0.40
"""Default model FLOPs utilisation: Llama 3 405B trained at 38-43% BF16 MFU on 8K-16K
H100s ("The Llama 3 Herd of Models", 2024, Table 4). It is an end-to-end figure (it pays
for the communication that was not hidden), so compute at 40% of peak plus the TP
communication modelled here errs on the slow side."""


def block_collectives(shape: BlockShape, tp: int, sequence_parallel: bool = False,
                      sublayers: tuple[str, ...] = SUBLAYERS, sp_saves: str = "gathered"
                      ) -> list[dict]:
    """The TP collectives of one block's forward and backward, as trace-like records.

    Each record has phase, module, op, bytes and group_size, like `tplab.trace` records,
    and its `role` (see ROLES); the order is the order they run in (backward visits the
    sublayers in reverse). `sublayers=("mlp",)` gives an MLP on its own. Under SP,
    `sp_saves="shard"` is Megatron's way of keeping a TP region's input for backward: its
    1/t sequence shard, all-gathered again in backward (one more all-gather per region,
    10 collectives instead of 8: 25% more bytes); "gathered" keeps the gathered input, as
    DTensor's plans do (Korthikanti et al. 2022, section 4.2.2).
    """
    if sp_saves not in SP_SAVES:
        raise ValueError(f"sp_saves must be one of {SP_SAVES}, not {sp_saves!r}")
    if tp <= 1:
        return []
    nbytes = shape.activation_bytes

    def rec(phase, module, op, role):
        return {"phase": phase, "module": module, "op": op, "bytes": nbytes,
                "group_size": tp, "role": role}

    records = []
    for sub in sublayers:
        if sequence_parallel:   # gather the sequence in, scatter the sum out
            records += [rec("forward", sub, "all_gather", "fwd_in"),
                        rec("forward", sub, "reduce_scatter", "fwd_out")]
        else:                   # g: sum the row-parallel partial outputs
            records.append(rec("forward", sub, "all_reduce", "fwd_out"))
    for sub in reversed(sublayers):
        if sequence_parallel:   # the transposes: all-gather of dy, reduce-scatter of dx
            records.append(rec("backward", sub, "all_gather", "bwd_out"))
            if sp_saves == "shard":
                records.append(rec("backward", sub, "all_gather", "regather"))
            records.append(rec("backward", sub, "reduce_scatter", "bwd_in"))
        else:                   # f: sum the input gradients of the column-parallel linears
            records.append(rec("backward", sub, "all_reduce", "bwd_in"))
    return records


def region_gemm_flops(shape: BlockShape) -> dict[str, dict[str, float]]:
    """Forward FLOPs of each region's column-parallel GEMM ("col": q, k, v or w1 (and w3))
    and row-parallel one ("row": the output projection or w2), over all TP ranks. Each
    GEMM's input-gradient ("dgrad") and weight-gradient ("wgrad") GEMMs cost the same."""
    h, t, f = shape.hidden, shape.tokens, shape.ffn_size
    kv_dim = (shape.kv_heads or shape.heads) * (h // shape.heads)
    return {"attention": {"col": 2 * t * h * (h + 2 * kv_dim), "row": 2 * t * h * h},
            "mlp": {"col": 2 * t * h * f * (2 if shape.gated else 1), "row": 2 * t * h * f}}


def comm_times(shape: BlockShape, tp: int, hw: Hardware, sequence_parallel: bool = False,
               algorithm: str = "ring", sublayers: tuple[str, ...] = SUBLAYERS,
               overlap: str = "none", sp_saves: str = "gathered", mfu: float = MFU,
               recompute: str = "none") -> list[dict]:
    """One block's TP records (`block_collectives`) with `time_s` (alpha-beta), `hidden_by`
    (the GEMM that `overlap` puts beside it, or None), `gemm_s` (that GEMM's time at `mfu`
    of peak on 1/tp of the work) and `exposed_s` = max(0, time_s - gemm_s): what stays on
    the critical path, assuming ideal overlap (a lower bound: an overlapped collective
    also takes SMs and memory bandwidth from the GEMM it hides behind)."""
    from tplab.cost.collectives import collective_time

    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {tuple(OVERLAPS)}, not {overlap!r}")
    if overlap == "async_tp" and not sequence_parallel:
        raise ValueError("overlap='async_tp' needs sequence_parallel=True: PyTorch's async "
                         "TP fuses all-gather + matmul and matmul + reduce-scatter")
    records = block_collectives(shape, tp, sequence_parallel, sublayers, sp_saves)
    if recompute == "full":   # the re-run forward issues its collectives again
        records += [dict(r) for r in records if r["phase"] == "forward"]
    mapping = OVERLAPS[overlap]
    if overlap == "async_tp" and tp > hw.gpus_per_node:
        mapping = {}   # symmetric memory needs every rank of the group on one NVLink domain
    gemms = region_gemm_flops(shape)
    for r in records:
        r["time_s"] = collective_time(r["op"], r["bytes"], tp, hw, algorithm)
        r["hidden_by"] = mapping.get(r["role"])
        r["gemm_s"] = 0.0
        if r["hidden_by"]:
            side = r["hidden_by"].split("_")[0]
            r["gemm_s"] = gemms[r["module"]][side] / (tp * hw.flops * mfu)
        r["exposed_s"] = max(0.0, r["time_s"] - r["gemm_s"])
    return records


def step_time(shape: BlockShape, tp: int, hw: Hardware, sequence_parallel: bool = False,
              algorithm: str = "ring", sublayers: tuple[str, ...] = SUBLAYERS,
              recompute: str = "none", precision: str = "mixed", optimizer: str = "adam",
              layout: str = "tplab", overlap: str = "none", sp_saves: str | None = None,
              mfu: float = MFU, dp: int = 1, zero: int = 0) -> dict:
    """Forward + backward time of the model's blocks on one micro-batch, N-way TP, and the
    memory one GPU needs for it (`tplab.cost.memory.gpu_memory`, for the whole model
    whatever `sublayers` says: param_bytes, grad_bytes, optimizer_bytes, activation_bytes,
    memory_bytes, and `fits`: within `hw.memory`).

    Compute runs at `mfu` of the GPU's peak (default `MFU`, 0.40, with its source); TP
    collectives at the link's bus bandwidth with NCCL's latencies (`tplab.cost.hardware`).
    `tp_comm_s` is all of the TP communication, `exposed_comm_s` what `overlap` leaves on
    the critical path ("none"; "megatron": the backward input-gradient all-reduce or
    reduce-scatter behind the weight-gradient GEMM; "async_tp": PyTorch's async TP, SP
    only, inside one NVLink domain; see `comm_times`), and `step_s` = compute + exposed.
    Throughput: `tokens_per_s_per_gpu` = the micro-batch's tokens / (step_s x tp), the
    quantity training maximises; `gpu_s` = step_s x tp.

    `dp` and `zero` shard the model states over data-parallel replicas in the memory
    (`gpu_memory`); they change no time here (the DP gradient traffic is not modelled).
    Under SP, `sp_saves` says how a region keeps its input for backward: "gathered"
    (DTensor, tplab's block) or "shard" (Megatron-LM: 1/t of it, gathered again in
    backward: memory saved, 25% more TP bytes); by default the layout's own ("tplab":
    gathered, "gpt": shard). Full recomputation runs the forward twice (4 passes instead
    of 3, and the forward's collectives twice); selective recomputation of the paper's GPT
    layer re-runs the attention scores, 4 b s^2 h FLOPs (Korthikanti et al. 2022, section 5).
    """
    from tplab.cost.memory import gpu_memory

    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of peak, 0 < mfu <= 1; got {mfu}")
    saves = sp_saves or ("shard" if layout == "gpt" else "gathered")
    flops = block_flops(shape, sublayers)
    passes = 4 if recompute == "full" else 3
    extra = 4 * shape.batch * shape.seq**2 * shape.hidden * (
        recompute == "selective" and layout == "gpt" and "attention" in sublayers)
    compute = shape.layers * (passes * flops + extra) / (tp * hw.flops * mfu)
    records = comm_times(shape, tp, hw, sequence_parallel, algorithm, sublayers, overlap,
                         saves, mfu, recompute)
    comm = shape.layers * sum(r["time_s"] for r in records)
    exposed = shape.layers * sum(r["exposed_s"] for r in records)
    applied = overlap
    if overlap == "async_tp" and tp > hw.gpus_per_node:
        applied = "none (async TP needs the TP group in one NVLink domain)"
    link = hw.link(tp).name if tp > 1 else "-"
    step = compute + exposed
    row = {"model": shape.name, "hardware": hw.name, "tp": tp, "link": link,
           "crosses_nodes": tp > hw.gpus_per_node, "compute_s": compute,
           "tp_comm_s": comm, "exposed_comm_s": exposed, "hidden_comm_s": comm - exposed,
           "step_s": step, "comm_fraction": exposed / step, "overlap": applied,
           "mfu": mfu, "tokens": shape.tokens, "gpu_s": step * tp,
           "tokens_per_s_per_gpu": shape.tokens / (step * tp)}
    row |= gpu_memory(shape, tp, sequence_parallel, recompute, precision, optimizer, layout,
                      sp_saves=saves, dp=dp, zero=zero)
    row["fits"] = row["memory_bytes"] <= hw.memory
    return row


def sweep(shape: BlockShape, hw: Hardware, tps=(1, 2, 4, 8, 16, 32, 64),
          **kw) -> list[dict]:
    """`step_time` for each TP degree in `tps` (keywords as for `step_time`), with
    `speedup`: the first row's step time over this row's."""
    rows = [step_time(shape, tp, hw, **kw) for tp in tps]
    for row in rows:
        row["speedup"] = rows[0]["step_s"] / row["step_s"]
    return rows


def comm_bound_tp(shape: BlockShape, hw: Hardware, max_tp: int = 1024, **kw) -> int | None:
    """The smallest power-of-two TP degree whose exposed TP communication takes longer than
    its compute; None if none up to `max_tp`."""
    tp = 2
    while tp <= max_tp:
        row = step_time(shape, tp, hw, **kw)
        if row["exposed_comm_s"] >= row["compute_s"]:
            return tp
        tp *= 2
    return None


OBJECTIVES = ("latency", "throughput")


def best_tp(rows: list[dict], objective: str = "latency",
            memory_limit: float | None = None) -> int | None:
    """The TP degree `sweep` rows recommend.

    objective="latency": the fastest micro-batch (smallest `step_s`), the question of
    serving one request or of a fixed number of GPUs per replica. objective="throughput":
    the most tokens per second per GPU (`tokens_per_s_per_gpu`), the question of training
    on a fixed budget of GPUs: TP never adds FLOP/s per GPU, so this is the smallest degree
    that fits unless overlap hides all of its communication. With `memory_limit` (bytes
    per GPU, e.g. `hw.memory`) only rows whose `memory_bytes` fit count; None when none
    fits. Ties go to the smaller degree.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    if memory_limit is not None:
        if memory_limit <= 0:
            raise ValueError(f"memory_limit is bytes per GPU, > 0; got {memory_limit}")
        if any("memory_bytes" not in r for r in rows):
            raise ValueError("best_tp(memory_limit=...) needs rows with 'memory_bytes' "
                             "(from sweep or step_time)")
        rows = [r for r in rows if r["memory_bytes"] <= memory_limit]
        if not rows:
            return None
    if objective == "throughput":
        if any("tokens_per_s_per_gpu" not in r for r in rows):
            raise ValueError("best_tp(objective='throughput') needs rows with "
                             "'tokens_per_s_per_gpu' (from sweep or step_time)")
        return min(rows, key=lambda r: (-r["tokens_per_s_per_gpu"], r["tp"]))["tp"]
    return min(rows, key=lambda r: (r["step_s"], r["tp"]))["tp"]


def mlp_comm_ratio(shape: BlockShape, tp: int, hw: Hardware, mfu: float = MFU) -> float:
    """Closed form of an MLP's TP communication time over its compute time, bytes terms
    only: 2 d (N-1) C / (3 m f B) with m matrices (2, or 3 if gated) and C = mfu x peak,
    which is d (N-1) C / (3 f B) for a plain MLP. Above 1, the MLP is communication-bound.

    Derivation: 2 all-reduces of T = bsh d bytes (forward g, backward f) take
    4 T (N-1) / (N B); 3 passes of 2 m bsh f FLOPs split N ways take 6 m bsh f / (N C).
    """
    if tp <= 1:
        return 0.0
    bw = hw.link(tp).params("all_reduce")[1]
    m = 3 if shape.gated else 2
    return 2 * shape.dtype_bytes * (tp - 1) * hw.flops * mfu / (3 * m * shape.ffn_size * bw)
