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
bytes; sequence parallelism saves activation memory, not time (Korthikanti et al. 2022).

Compute: forward FLOPs of one block, counting matmuls (2 FLOPs per multiply-add), are
2bs h (h + 2 h_kv) for q, k, v, 2bs h^2 for the output projection, 4 b s^2 h for the
scores and their product with v, and 2bs h f (3 matrices with a gated MLP such as SwiGLU,
2 without). With f = 4h and no grouped-query attention this is 24 b s h^2 + 4 b s^2 h
(Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters
using Megatron-LM", section 5.1). The backward pass costs twice the forward.

Where TP becomes communication-bound: for the MLP alone the ratio of TP communication to
compute time (bytes terms only, ring all-reduce, N-way TP, peak C FLOP/s, bandwidth B) is
d (N-1) C / (3 f B): it does not depend on the batch, grows with N and shrinks with the
feed-forward size f. This is the JAX scaling book's result ("How to Scale Your Model",
section "Training", model parallelism is comms-bound once N exceeds about f / (C/B)),
with the all-reduce's factor 2 (N-1)/N kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tplab.cost.collectives import records_time
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


def block_collectives(shape: BlockShape, tp: int, sequence_parallel: bool = False,
                      sublayers: tuple[str, ...] = SUBLAYERS) -> list[dict]:
    """The TP collectives of one block's forward and backward, as trace-like records.

    Each record has phase, module, op, bytes and group_size, like `tplab.trace` records;
    the order is the order they run in (backward visits the sublayers in reverse).
    `sublayers=("mlp",)` gives an MLP on its own.
    """
    if tp <= 1:
        return []
    nbytes = shape.activation_bytes

    def rec(phase, module, op):
        return {"phase": phase, "module": module, "op": op, "bytes": nbytes,
                "group_size": tp}

    records = []
    for sub in sublayers:
        if sequence_parallel:   # gather the sequence in, scatter the sum out
            records += [rec("forward", sub, "all_gather"), rec("forward", sub, "reduce_scatter")]
        else:                   # g: sum the row-parallel partial outputs
            records.append(rec("forward", sub, "all_reduce"))
    for sub in reversed(sublayers):
        if sequence_parallel:   # the transposes: all-gather of dy, reduce-scatter of dx
            records += [rec("backward", sub, "all_gather"), rec("backward", sub, "reduce_scatter")]
        else:                   # f: sum the input gradients of the column-parallel linears
            records.append(rec("backward", sub, "all_reduce"))
    return records


def step_time(shape: BlockShape, tp: int, hw: Hardware, sequence_parallel: bool = False,
              algorithm: str = "ring", sublayers: tuple[str, ...] = SUBLAYERS,
              recompute: str = "none", precision: str = "mixed", optimizer: str = "adam",
              layout: str = "tplab") -> dict:
    """Forward + backward time of the model's blocks on one micro-batch, N-way TP, and the
    memory one GPU needs for it (`tplab.cost.memory.gpu_memory`, for the whole model
    whatever `sublayers` says: param_bytes, grad_bytes, optimizer_bytes, activation_bytes,
    memory_bytes, and `fits`: within `hw.memory`).

    Compute runs at the GPU's peak; TP collectives run at the link's peak and do not
    overlap compute (Megatron's TP collectives sit on the critical path). Both are lower
    bounds, so the split between them is what to read, more than the total. Full
    recomputation runs the forward twice (4 passes instead of 3, and the forward's
    collectives twice); selective recomputation of the paper's GPT layer re-runs the
    attention scores, 4 b s^2 h FLOPs (Korthikanti et al. 2022, section 5).
    """
    from tplab.cost.memory import gpu_memory

    flops = block_flops(shape, sublayers)
    passes = 4 if recompute == "full" else 3
    extra = 4 * shape.batch * shape.seq**2 * shape.hidden * (
        recompute == "selective" and layout == "gpt" and "attention" in sublayers)
    compute = shape.layers * (passes * flops + extra) / (tp * hw.flops)
    records = block_collectives(shape, tp, sequence_parallel, sublayers)
    if recompute == "full":   # the re-run forward issues its collectives again
        records += [r for r in records if r["phase"] == "forward"]
    comm = shape.layers * records_time(records, hw, algorithm)
    link = hw.link(tp).name if tp > 1 else "-"
    row = {"model": shape.name, "hardware": hw.name, "tp": tp, "link": link,
           "crosses_nodes": tp > hw.gpus_per_node, "compute_s": compute,
           "tp_comm_s": comm, "step_s": compute + comm,
           "comm_fraction": comm / (compute + comm)}
    row |= gpu_memory(shape, tp, sequence_parallel, recompute, precision, optimizer, layout)
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
    """The smallest power-of-two TP degree whose TP communication takes longer than its
    compute; None if none up to `max_tp`."""
    tp = 2
    while tp <= max_tp:
        row = step_time(shape, tp, hw, **kw)
        if row["tp_comm_s"] >= row["compute_s"]:
            return tp
        tp *= 2
    return None


def best_tp(rows: list[dict], memory_limit: float | None = None) -> int | None:
    """Where TP stops paying: the TP degree of the fastest step among `sweep` rows. With
    `memory_limit` (bytes per GPU, e.g. `hw.memory`), the fastest among the rows whose
    `memory_bytes` fit in it; None when none fits."""
    if memory_limit is not None:
        if memory_limit <= 0:
            raise ValueError(f"memory_limit is bytes per GPU, > 0; got {memory_limit}")
        if any("memory_bytes" not in r for r in rows):
            raise ValueError("best_tp(memory_limit=...) needs rows with 'memory_bytes' "
                             "(from sweep or step_time)")
        rows = [r for r in rows if r["memory_bytes"] <= memory_limit]
        if not rows:
            return None
    return min(rows, key=lambda r: r["step_s"])["tp"]


def mlp_comm_ratio(shape: BlockShape, tp: int, hw: Hardware) -> float:
    """Closed form of an MLP's TP communication time over its compute time, bytes terms
    only: 2 d (N-1) C / (3 m f B) with m matrices (2, or 3 if gated), which is
    d (N-1) C / (3 f B) for a plain MLP. Above 1, the MLP is communication-bound.

    Derivation: 2 all-reduces of T = bsh d bytes (forward g, backward f) take
    4 T (N-1) / (N B); 3 passes of 2 m bsh f FLOPs split N ways take 6 m bsh f / (N C).
    """
    if tp <= 1:
        return 0.0
    _, bw = hw.link(tp).params("all_reduce")
    m = 3 if shape.gated else 2
    return 2 * shape.dtype_bytes * (tp - 1) * hw.flops / (3 * m * shape.ffn_size * bw)
