"""A transformer block under Megatron tensor parallelism, on paper: its bytes and FLOPs.

Communication per block, for b sequences of s tokens, hidden size h, d bytes per element,
so that every message is T = b s h d bytes (Shoeybi et al. 2019, "Megatron-LM", section 3;
Korthikanti et al. 2022, "Reducing activation recomputation in large transformer models",
section 4.2.2; the Ultra-Scale Playbook, "Tensor Parallelism" and "Sequence Parallelism"):

| plan | forward | backward |
|---|---|---|
| TP | 2 all-reduce (g after attention and MLP) | 2 all-reduce (f at their inputs) |
| TP + SP | 2 all-gather + 2 reduce-scatter | 2 all-gather + 2 reduce-scatter |

Past TP = n_kv_heads (grouped-query attention with fewer KV heads than ranks) Megatron-LM
still splits the fused QKV projection t ways, then all-gathers its output so that each rank
can take its query group's k and v (megatron/core/transformer/attention.py,
`get_query_key_value_tensors`, `num_query_groups < world_size`): one more forward
all-gather of b s (h + 2 h_kv) d bytes, and its backward reduce-scatter. On the wire that
adds 2 (h + 2 h_kv) / (8 h) to the layer's TP bytes: 37.5% for Llama-3 8B, 31% for 70B.
`tp_allowed` says which degrees a shape allows at all: the query heads and the feed-forward
size must divide by t, and t must divide, or be a multiple of, the KV heads.

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

# BlockShape, MODELS and scaled are imported from here too
from tplab.cost.shapes import MODELS, BlockShape, scaled  # noqa: F401
from tplab.cost.validate import check_bool, check_choice, check_int, check_sublayers, check_type

SUBLAYERS = ("attention", "mlp")


def tp_allowed(shape: BlockShape, tp: int) -> str | None:
    """None if a framework can split `shape` `tp` ways, else why not: the query heads and
    the feed-forward size must divide by tp, and tp must divide the KV heads or be a
    multiple of them (Megatron-LM then gathers the QKV output; see the module doc)."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    kv = shape.kv_heads or shape.heads
    if shape.heads % tp:
        return f"TP {tp} does not divide the {shape.heads} query heads"
    if kv % tp and tp % kv:
        return f"TP {tp} neither divides nor is a multiple of the {kv} KV heads"
    if shape.ffn_size % tp:
        return f"TP {tp} does not divide the feed-forward size {shape.ffn_size}"
    return None


def allowed_tps(shape: BlockShape, tps=(1, 2, 4, 8, 16, 32, 64)) -> tuple[int, ...]:
    """The degrees of `tps` that `shape` allows (`tp_allowed`)."""
    return tuple(t for t in tps if tp_allowed(shape, t) is None)


def check_tp(shape: BlockShape, tp: int) -> int:
    """`tp` if the shape allows it, else a ValueError naming tp and why."""
    why = tp_allowed(shape, tp)
    if why:
        raise ValueError(f"tp = {tp} is not a TP degree {shape.name or 'this shape'} "
                         f"allows: {why}")
    return tp


def kv_replicated(shape: BlockShape, tp: int) -> bool:
    """True when tp exceeds the KV heads: each KV head lives on several ranks."""
    return tp > (shape.kv_heads or shape.heads)


def block_flops(shape: BlockShape, sublayers: tuple[str, ...] = SUBLAYERS,
                causal: bool = False) -> int:
    """Forward FLOPs of one block on one micro-batch, over all TP ranks together.

    `causal=False` (the default) counts the attention scores and values in full,
    4 b s^2 h, as Narayanan et al. 2021 (section 5.1) do; `causal=True` counts what flash
    attention with a causal mask computes, about half (it skips the tiles above the
    diagonal: FlashAttention-2, Dao 2023, section 3.1), 2 b s^2 h."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_sublayers("sublayers", sublayers)
    check_bool("causal", causal)
    h, t = shape.hidden, shape.tokens
    qkv = 2 * t * h * (h + 2 * shape.kv_dim)
    out = 2 * t * h * h
    scores = 4 * shape.batch * shape.seq**2 * h // (2 if causal else 1)
    mlp = 2 * t * h * shape.ffn_size * (3 if shape.gated else 2)
    return ("attention" in sublayers) * (qkv + out + scores) + ("mlp" in sublayers) * mlp


def lm_head_flops(shape: BlockShape) -> int:
    """Forward FLOPs of the lm head on one micro-batch, all TP ranks together: the logits,
    2 b s h V. Three passes of it are Narayanan et al. 2021's V / (12 h L) term of
    72 b s L h^2 (1 + s/(6h) + V/(12 h L)) (section 5.1). 0 without a vocabulary."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    return 2 * shape.tokens * shape.hidden * shape.vocab


ROLES = ("fwd_in", "fwd_out", "bwd_out", "bwd_in", "regather", "qkv_gather", "qkv_scatter")
"""Where a TP record sits in its region (its "role"): entering it in forward (SP's
all-gather), leaving it in forward (g: all-reduce, or SP's reduce-scatter), the
conjugate of leaving it in backward (SP's all-gather of dy), the conjugate of entering it
in backward (f: all-reduce, or SP's reduce-scatter of dx), and Megatron's second
all-gather of a sequence-sharded input in backward (`sp_saves="shard"`), and past
n_kv_heads the all-gather of the QKV output and its backward reduce-scatter."""

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
"""Default compute efficiency of a large, well-shaped GEMM: Llama 3 405B trained at 38-43%
BF16 MFU on 8K-16K H100s ("The Llama 3 Herd of Models", 2024, Table 4). It is an
end-to-end figure (it pays for the communication that was not hidden), so compute at 40%
of peak plus the communication modelled here errs on the slow side. Smaller per-rank GEMMs
run below it (`tplab.cost.kernels.gemm_efficiency`); each row carries the `mfu` it ended up with."""


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
    DTensor's plans do (Korthikanti et al. 2022, section 4.2.2). Past tp = n_kv_heads the
    attention also all-gathers its QKV output in forward and reduce-scatters its gradient
    in backward (Megatron-LM; see the module doc).
    """
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    check_bool("sequence_parallel", sequence_parallel)
    check_sublayers("sublayers", sublayers, allowed=None)
    check_choice("sp_saves", sp_saves, SP_SAVES)
    if tp <= 1:
        return []
    nbytes = shape.activation_bytes
    qkv_bytes = shape.tokens * (shape.hidden + 2 * shape.kv_dim) * shape.dtype_bytes
    gather_qkv = kv_replicated(shape, tp)

    def rec(phase, module, op, role, size=nbytes):
        return {"phase": phase, "module": module, "op": op, "bytes": size,
                "group_size": tp, "role": role}

    records = []
    for sub in sublayers:
        if sequence_parallel:   # gather the sequence in, scatter the sum out
            records.append(rec("forward", sub, "all_gather", "fwd_in"))
        if gather_qkv and sub == "attention":
            records.append(rec("forward", sub, "all_gather", "qkv_gather", qkv_bytes))
        records.append(rec("forward", sub, "reduce_scatter" if sequence_parallel
                           else "all_reduce", "fwd_out"))   # g: sum the partial outputs
    for sub in reversed(sublayers):
        if sequence_parallel:   # the transposes: all-gather of dy, reduce-scatter of dx
            records.append(rec("backward", sub, "all_gather", "bwd_out"))
        if gather_qkv and sub == "attention":
            records.append(rec("backward", sub, "reduce_scatter", "qkv_scatter", qkv_bytes))
        if sequence_parallel:
            if sp_saves == "shard":
                records.append(rec("backward", sub, "all_gather", "regather"))
            records.append(rec("backward", sub, "reduce_scatter", "bwd_in"))
        else:                   # f: sum the input gradients of the column-parallel linears
            records.append(rec("backward", sub, "all_reduce", "bwd_in"))
    return records
