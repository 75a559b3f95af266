"""A training step under TP, on paper: compute (per GEMM shape), TP and DP communication,
memory, and the TP degree the rows recommend.

`step_time` prices one micro-batch through every layer, forward and backward, on one GPU of
a TP group of `tp`: compute from the per-rank GEMM shapes (each GEMM at `mfu` x its shape's
efficiency in the one GEMM model, `tplab.cost.kernels.gemm_efficiency`; `gemm="flat"`:
every GEMM at `mfu`), the block's TP
collectives (`tplab.cost.transformer.block_collectives`) priced by NCCL's model
(`tplab.cost.nccl`), what `overlap` hides of them, the data-parallel traffic
(`tplab.cost.data_parallel`) and the memory (`tplab.cost.memory.gpu_memory`).
The module doc of `tplab.cost.transformer` gives the formulas.
"""

from __future__ import annotations

from tplab.cost.collectives import ALGORITHMS, PROTOCOLS, collective_time
from tplab.cost.data_parallel import dp_times
from tplab.cost.hardware import Hardware
from tplab.cost.kernels import gemm_efficiency
from tplab.cost.memory import NORMS, PRECISIONS, SWIGLUS, gpu_memory
from tplab.cost.transformer import (
    MFU,
    OVERLAPS,
    SP_SAVES,
    SUBLAYERS,
    BlockShape,
    allowed_tps,
    block_collectives,
    block_flops,
    check_tp,
    kv_replicated,
    lm_head_flops,
    tp_allowed,
)
from tplab.cost.validate import (
    check_bool,
    check_choice,
    check_degrees,
    check_int,
    check_number,
    check_rows,
    check_sublayers,
    check_type,
)

GEMMS = ("shape", "flat")
OBJECTIVES = ("throughput", "latency")
RECOMPUTES = ("none", "selective", "full")
TPS = (1, 2, 4, 8, 16, 32, 64)


def linear_pass_gemms(tokens: int, d_in: int, d_out: int) -> list[tuple[int, int, int]]:
    """The three GEMMs of one linear layer y = x W^T with x (tokens, d_in): forward
    (tokens, d_out, d_in), input gradient (tokens, d_in, d_out), weight gradient
    (d_out, d_in, tokens), as (m, n, k)."""
    return [(tokens, d_out, d_in), (tokens, d_in, d_out), (d_out, d_in, tokens)]


def region_linears(shape: BlockShape, tp: int) -> dict[str, dict[str, tuple[int, int]]]:
    """Per rank, (d_in, d_out) of each region's column-parallel linear ("col": the fused
    q, k, v; the fused w1 (and w3)) and row-parallel one ("row": wo; w2)."""
    h, f = shape.hidden, shape.ffn_size
    return {"attention": {"col": (h, (h + 2 * shape.kv_dim) // tp), "row": (h // tp, h)},
            "mlp": {"col": (h, f * (2 if shape.gated else 1) // tp), "row": (f // tp, h)}}


def gemm_times(shape: BlockShape, tp: int, hw: Hardware, mfu: float = MFU,
               gemm: str = "shape") -> dict[str, dict[str, float]]:
    """Seconds of each region's GEMMs on one rank: {region: {"col_fwd", "col_dgrad",
    "col_wgrad", "row_fwd", "row_dgrad", "row_wgrad": s}}, each at `mfu` x its shape's
    efficiency ("shape") or at `mfu` ("flat")."""
    out = {}
    for region, linears in region_linears(shape, tp).items():
        out[region] = {}
        for side, (d_in, d_out) in linears.items():
            for kind, (m, n, k) in zip(("fwd", "dgrad", "wgrad"),
                                       linear_pass_gemms(shape.tokens, d_in, d_out),
                                       strict=True):
                eff = gemm_efficiency(m, n, k, hw, shape.dtype_bytes) if gemm == "shape" else 1
                out[region][f"{side}_{kind}"] = 2 * m * n * k / (hw.flops * mfu * eff)
    return out


def lm_head_times(shape: BlockShape, tp: int, hw: Hardware, mfu: float = MFU,
                  gemm: str = "shape") -> tuple[float, float]:
    """(forward s, backward s) of the lm head's GEMMs on one rank: (tokens, h) by
    (h, V / tp), the vocabulary split t ways (Megatron-LM's ColumnParallelLinear output
    layer; V rounded up to a whole number of rows per rank). (0, 0) without a vocabulary."""
    if not shape.vocab:
        return 0.0, 0.0
    times = []
    for m, n, k in linear_pass_gemms(shape.tokens, shape.hidden, -(-shape.vocab // tp)):
        eff = gemm_efficiency(m, n, k, hw, shape.dtype_bytes) if gemm == "shape" else 1
        times.append(2 * m * n * k / (hw.flops * mfu * eff))
    return times[0], times[1] + times[2]


def comm_times(shape: BlockShape, tp: int, hw: Hardware, sequence_parallel: bool = False,
               algorithm: str = "ring", sublayers: tuple[str, ...] = SUBLAYERS,
               overlap: str = "none", sp_saves: str = "gathered", mfu: float = MFU,
               recompute: str = "none", protocol: str = "auto", gemm: str = "shape"
               ) -> list[dict]:
    """One block's TP records (`block_collectives`) with `time_s` (NCCL's model), `hidden_by`
    (the GEMM that `overlap` puts beside it, or None), `gemm_s` (that GEMM's time) and
    `exposed_s` = max(0, time_s - gemm_s): what stays on the critical path, assuming ideal
    overlap (a lower bound: an overlapped collective also takes SMs and memory bandwidth
    from the GEMM it hides behind)."""
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    check_choice("overlap", overlap, tuple(OVERLAPS))
    check_choice("recompute", recompute, RECOMPUTES)
    check_number("mfu", mfu, minimum=1e-6, maximum=1.0)  # below: not an efficiency
    check_choice("gemm", gemm, GEMMS)
    if overlap == "async_tp" and not sequence_parallel:
        raise ValueError("overlap='async_tp' needs sequence_parallel=True: PyTorch's async "
                         "TP fuses all-gather + matmul and matmul + reduce-scatter")
    records = block_collectives(shape, tp, sequence_parallel, sublayers, sp_saves)
    if recompute == "full":   # the re-run forward issues its collectives again
        records += [dict(r) for r in records if r["phase"] == "forward"]
    mapping = OVERLAPS[overlap]
    if overlap == "async_tp" and tp > hw.gpus_per_node:
        mapping = {}   # symmetric memory needs every rank of the group on one NVLink domain
    gemms = gemm_times(shape, tp, hw, mfu, gemm)
    for r in records:
        r["time_s"] = collective_time(r["op"], r["bytes"], tp, hw, algorithm, protocol)
        r["hidden_by"] = mapping.get(r["role"])
        r["gemm_s"] = gemms[r["module"]][r["hidden_by"]] if r["hidden_by"] else 0.0
        r["exposed_s"] = max(0.0, r["time_s"] - r["gemm_s"])
    return records


def check_step(shape, tp, hw, sequence_parallel, algorithm, sublayers, recompute, precision,
               layout, overlap, sp_saves, mfu, dp, zero, protocol, gemm, norm,
               micro_batches, dp_overlap, swiglu, causal, lm_head) -> None:
    """The one check of `step_time`'s arguments."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    check_tp(shape, tp)
    check_bool("sequence_parallel", sequence_parallel)
    check_choice("algorithm", algorithm, ALGORITHMS)
    check_choice("protocol", protocol, PROTOCOLS)
    check_sublayers("sublayers", sublayers)
    check_choice("recompute", recompute, RECOMPUTES)
    check_choice("precision", precision, PRECISIONS)
    check_choice("layout", layout, ("tplab", "gpt"))
    check_choice("overlap", overlap, tuple(OVERLAPS))
    if sp_saves is not None:
        check_choice("sp_saves", sp_saves, SP_SAVES)
    check_number("mfu", mfu, minimum=1e-6, maximum=1.0)  # below: not an efficiency
    check_int("dp", dp)
    check_int("zero", zero, minimum=0)
    check_choice("gemm", gemm, GEMMS)
    check_choice("norm", norm, NORMS)
    check_int("micro_batches", micro_batches)
    check_bool("dp_overlap", dp_overlap)
    check_choice("swiglu", swiglu, SWIGLUS)
    check_bool("causal", causal)
    check_bool("lm_head", lm_head)


def step_time(shape: BlockShape, tp: int, hw: Hardware, sequence_parallel: bool = False,
              algorithm: str = "ring", sublayers: tuple[str, ...] = SUBLAYERS,
              recompute: str = "none", precision: str = "mixed", optimizer: str = "adam",
              layout: str = "tplab", overlap: str = "none", sp_saves: str | None = None,
              mfu: float = MFU, dp: int = 1, zero: int = 0, protocol: str = "auto",
              gemm: str = "shape", norm: str = "composite", micro_batches: int = 1,
              dp_overlap: bool = True, swiglu: str = "composite", causal: bool = True,
              lm_head: bool = True) -> dict:
    """Forward + backward time of the model's blocks on one micro-batch, N-way TP, and the
    memory one GPU needs for it (`gpu_memory`, for the whole model whatever `sublayers`
    says: param_bytes, grad_bytes, optimizer_bytes, activation_bytes, memory_bytes, and
    `fits`: within `hw.usable_memory`). `tp` must be a degree the heads allow (`tp_allowed`).

    Compute (`layer_compute`, `step_model_flops`): each per-rank GEMM at `mfu` (default
    `MFU`, 0.40, with its source) times its shape's efficiency (`gemm="shape"`; "flat": all
    at `mfu`); the row's `mfu` is the fraction of peak its compute reached. TP collectives:
    NCCL's model (`algorithm`, `protocol`). `tp_comm_s` is all of the TP communication,
    `exposed_comm_s` what `overlap` leaves on the critical path ("none"; "megatron": the
    backward input-gradient all-reduce or reduce-scatter behind the weight-gradient GEMM;
    "async_tp": PyTorch's async TP, SP only, inside one NVLink domain). DP: `dp_comm_s`
    (gradient reduction and ZeRO's gathers over `dp` replicas, per micro-batch with
    `micro_batches` per optimizer step) and `dp_exposed_s` (what `dp_overlap` leaves
    exposed). `step_s` = compute + exposed TP + exposed DP. Throughput:
    `tokens_per_s_per_gpu` = tokens / (step_s x tp), what training maximises; `gpu_s` =
    step_s x tp.

    `precision="mixed"` is Megatron-LM's bf16 recipe (fp32 gradients: 18 bytes per
    parameter with Adam; "mixed_bf16_grads" 16). Under SP, `sp_saves`: "gathered" (DTensor,
    tplab's block) or "shard" (Megatron-LM: 25% more TP bytes); by default the layout's own.
    `norm`, `swiglu`: the RMSNorm and SwiGLU paths ("composite": tplab's, measured on CPU;
    "fused": CUDA's / Megatron-LM's; `tplab.cost.BLOCK_SAVES` names both blocks).
    `recompute` and `causal`: `layer_compute`. `lm_head` (default True, with the whole block
    and a vocabulary): the lm head's GEMMs, split over the vocabulary, are computed too
    (`lm_head_s`; Narayanan et al. 2021's V / (12 h L) term); the embedding's lookup and the
    head's TP collectives (a few messages of b s h d bytes per step) are left out.
    """
    check_step(shape, tp, hw, sequence_parallel, algorithm, sublayers, recompute, precision,
               layout, overlap, sp_saves, mfu, dp, zero, protocol, gemm, norm,
               micro_batches, dp_overlap, swiglu, causal, lm_head)
    saves = sp_saves or ("shard" if layout == "gpt" else "gathered")
    forward, backward = layer_compute(shape, tp, hw, sublayers, recompute, layout, mfu, gemm,
                                      causal)
    head = lm_head and set(sublayers) == set(SUBLAYERS) and shape.vocab > 0
    head_fwd, head_bwd = lm_head_times(shape, tp, hw, mfu, gemm) if head else (0.0, 0.0)
    records = comm_times(shape, tp, hw, sequence_parallel, algorithm, sublayers, overlap,
                         saves, mfu, recompute, protocol, gemm)
    dp_row = dp_times(shape, tp, hw, dp, zero, precision, micro_batches, dp_overlap,
                      shape.layers * forward + head_fwd, shape.layers * backward + head_bwd)
    compute = shape.layers * (forward + backward) + head_fwd + head_bwd
    flops = step_model_flops(shape, sublayers, recompute, layout, causal, head)
    row = step_row(shape, tp, hw, compute, records, dp_row, overlap, flops,
                   head_fwd + head_bwd)
    row |= {"dp": dp, "zero": zero, "precision": precision, "norm": norm, "swiglu": swiglu,
            "causal": causal}
    row |= gpu_memory(shape, tp, sequence_parallel, recompute, precision, optimizer, layout,
                      sp_saves=saves, dp=dp, zero=zero, norm=norm, swiglu=swiglu)
    row["fits"] = row["memory_bytes"] <= hw.usable_memory
    return row


def score_flops(shape: BlockShape, causal: bool = True) -> float:
    """FLOPs of one layer's attention scores and values, forward: 4 b s^2 h, half of it
    under a causal mask (flash attention skips the masked tiles)."""
    return 4 * shape.batch * shape.seq**2 * shape.hidden / (2 if causal else 1)


def layer_compute(shape: BlockShape, tp: int, hw: Hardware, sublayers=SUBLAYERS,
                  recompute: str = "none", layout: str = "tplab", mfu: float = MFU,
                  gemm: str = "shape", causal: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's `sublayers` on one rank: the linears'
    GEMMs (`gemm_times`) and, with attention, its scores and values at `mfu` (flash
    attention; backward twice the forward). Full recomputation runs the forward twice;
    selective recomputation of the paper's GPT layer (`layout="gpt"`) re-runs the
    attention scores, 4 b s^2 h FLOPs (Korthikanti et al. 2022, section 5)."""
    gemms = gemm_times(shape, tp, hw, mfu, gemm)
    forward = backward = 0.0
    for sub in sublayers:
        g = gemms[sub]
        forward += g["col_fwd"] + g["row_fwd"]
        backward += g["col_dgrad"] + g["col_wgrad"] + g["row_dgrad"] + g["row_wgrad"]
    scores = score_flops(shape, causal) / (tp * hw.flops * mfu)
    if "attention" in sublayers:
        forward, backward = forward + scores, backward + 2 * scores
    if recompute == "full":
        backward += forward
    elif recompute == "selective" and layout == "gpt" and "attention" in sublayers:
        backward += scores
    return forward, backward


def step_model_flops(shape: BlockShape, sublayers=SUBLAYERS, recompute: str = "none",
                     layout: str = "tplab", causal: bool = True, head: bool = True) -> float:
    """The FLOPs a step's compute performs, recomputation included (the row's `mfu`
    divides them by the compute time): 3 passes of each block (4 under full
    recomputation), the selective recomputation's scores, and the LM head's 3 passes."""
    passes = 4 if recompute == "full" else 3
    extra = score_flops(shape, causal) * (
        recompute == "selective" and layout == "gpt" and "attention" in sublayers)
    return (shape.layers * (passes * block_flops(shape, sublayers, causal) + extra)
            + 3 * lm_head_flops(shape) * head)


def step_row(shape: BlockShape, tp: int, hw: Hardware, compute: float, records: list[dict],
             dp_row: dict, overlap: str, model_flops: float, head_s: float) -> dict:
    """`step_time`'s row from its parts: the compute, the TP collectives' records (per
    layer), the DP row (`dp_times`), the overlap asked for and the FLOPs computed."""
    comm = shape.layers * sum(r["time_s"] for r in records)
    exposed = shape.layers * sum(r["exposed_s"] for r in records)
    applied = overlap
    if overlap == "async_tp" and tp > hw.gpus_per_node:
        applied = "none (async TP needs the TP group in one NVLink domain)"
    step = compute + exposed + dp_row["dp_exposed_s"]
    return {"model": shape.name, "hardware": hw.name, "tp": tp,
            "link": hw.link(tp).name if tp > 1 else "-",
            "crosses_nodes": tp > hw.gpus_per_node, "compute_s": compute,
            "tp_comm_s": comm, "exposed_comm_s": exposed, "hidden_comm_s": comm - exposed,
            "dp_comm_s": dp_row["dp_comm_s"], "dp_exposed_s": dp_row["dp_exposed_s"],
            "dp_link": dp_row["dp_link"], "step_s": step,
            "comm_fraction": (exposed + dp_row["dp_exposed_s"]) / step, "overlap": applied,
            "mfu": model_flops / (compute * tp * hw.flops),
            "kv_replicated": kv_replicated(shape, tp), "lm_head_s": head_s,
            "tokens": shape.tokens, "gpu_s": step * tp,
            "tokens_per_s_per_gpu": shape.tokens / (step * tp)}


def sweep(shape: BlockShape, hw: Hardware, tps=None, **kw) -> list[dict]:
    """`step_time` for each TP degree in `tps` (keywords as for `step_time`), with
    `speedup`: the first row's step time over this row's. `tps=None`: the powers of two
    up to 64 that the shape's heads allow (`allowed_tps`); a degree they do not allow is
    refused (ValueError naming it), as no framework can run it."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    tps = allowed_tps(shape, TPS) if tps is None else check_degrees("tps", tps)
    refused = [t for t in tps if t not in allowed_tps(shape, (t,))]
    if refused:
        raise ValueError(f"tps = {tps}: tp = {refused[0]} is not a TP degree "
                         f"{shape.name or 'this shape'} allows (cost.allowed_tps(shape, tps) "
                         f"keeps those it does): {tp_allowed(shape, refused[0])}")
    rows = [step_time(shape, tp, hw, **kw) for tp in tps]
    for row in rows:
        row["speedup"] = rows[0]["step_s"] / row["step_s"]
    return rows


def comm_bound_tp(shape: BlockShape, hw: Hardware, max_tp: int = 1024, **kw) -> int | None:
    """The smallest power-of-two TP degree whose exposed TP communication takes longer than
    its compute, among those the heads allow; None if none up to `max_tp`."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    check_int("max_tp", max_tp)
    tp = 2
    while tp <= max_tp and tp in allowed_tps(shape, (tp,)):
        row = step_time(shape, tp, hw, **kw)
        if row["exposed_comm_s"] >= row["compute_s"]:
            return tp
        tp *= 2
    return None


def best_tp(rows: list[dict], objective: str = "throughput",
            memory_limit: float | None = None) -> int | None:
    """The TP degree `sweep` rows recommend.

    objective="throughput" (the default): the most tokens per second per GPU
    (`tokens_per_s_per_gpu`), the question of training on a fixed budget of GPUs: with a
    memory limit, memory forces TP up and communication pushes it down.
    objective="latency": the fastest micro-batch (smallest `step_s`), the question of
    serving one request on a group of GPUs, or of a fixed number of GPUs per replica. With
    `memory_limit` (bytes per GPU, e.g. `hw.usable_memory`) only rows whose `memory_bytes`
    fit count; None when none fits. Ties go to the smaller degree.
    """
    check_choice("objective", objective, OBJECTIVES)
    keys = ["tp", "tokens_per_s_per_gpu" if objective == "throughput" else "step_s"]
    if memory_limit is not None:
        check_number("memory_limit", memory_limit, strict=True)
        keys.append("memory_bytes")
    rows = check_rows("rows", rows, keys)
    if memory_limit is not None:
        rows = [r for r in rows if r["memory_bytes"] <= memory_limit]
        if not rows:
            return None
    if objective == "throughput":
        return min(rows, key=lambda r: (-r["tokens_per_s_per_gpu"], r["tp"]))["tp"]
    return min(rows, key=lambda r: (r["step_s"], r["tp"]))["tp"]


def mlp_comm_ratio(shape: BlockShape, tp: int, hw: Hardware, mfu: float = MFU) -> float:
    """Closed form of an MLP's TP communication time over its compute time, bytes terms
    only: 2 d (N-1) C / (3 m f B) with m matrices (2, or 3 if gated) and C = mfu x peak,
    which is d (N-1) C / (3 f B) for a plain MLP. Above 1, the MLP is communication-bound.

    Derivation: 2 all-reduces of T = bsh d bytes (forward g, backward f) take
    4 T (N-1) / (N B); 3 passes of 2 m bsh f FLOPs split N ways take 6 m bsh f / (N C).
    B is the Simple ring's bus bandwidth (the protocol large messages take).
    """
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    check_number("mfu", mfu, minimum=1e-6, maximum=1.0)  # below: not an efficiency
    if tp <= 1:
        return 0.0
    bw = hw.link(tp).params("all_reduce")[1]
    m = 3 if shape.gated else 2
    return 2 * shape.dtype_bytes * (tp - 1) * hw.flops * mfu / (3 * m * shape.ffn_size * bw)
