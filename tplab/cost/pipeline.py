"""Pipeline, data-parallel and memory terms of a `TrainingRun` (`tplab.cost.training_run`).

Pipeline (Narayanan et al. 2021, sections 2.2 and 4.1; Korthikanti et al. 2022, 4.2.3):

- Stages: the layers split evenly over p x v virtual stages, or, as Megatron-LM's
  `account_for_embedding_in_pipeline_split` and `account_for_loss_in_pipeline_split` and
  Llama 3 (section 3.3.2: "we reduce one Transformer layer each from the first and the last
  stages") do, with the embedding and the LM head counted as a layer each. The slowest
  stage (the last one carries the head) sets the pace.
- Bubble: (p - 1) / v of one stage's micro-batch time per step, (p-1)/(v m) of the step.
- P2P: each stage boundary sends b s h / (t cp) activations per rank (Megatron-LM's
  scatter-gather over the TP ranks, Narayanan 2021 section 4.1), over one NIC per GPU when
  TP x CP fill the node. Non-interleaved 1F1B waits on 2 m of them per step; interleaved
  (with `--overlap-p2p-comm`) only the 2 (p - 1) of the fill and the drain. Without it
  (`TrainingRun(p2p_overlap=False)`: Megatron-LM before 2023-05-31, f9283c5a, whose
  `_communicate` waits on `batch_isend_irecv` and then `torch.cuda.synchronize()`) the
  interleaved schedule waits on each exchange: its warm-up's 2 (p - 1) + (v - 1) p, then
  one combined send/receive per forward chunk, m v.
- First stage memory: 1F1B keeps min(p, m) micro-batches in flight, interleaving
  p + (p-1)/v, at most m (`in_flight`); under Megatron's embedding/loss split, its most
  loaded rank as its schedule fills it (`held_layers`). Under torch.distributed.pipelining
  (`Stack.pipelining == "torch"`, torchtitan) every rank is followed through its schedule
  with what `PipelineStage` keeps, and the largest is taken (`tplab.cost.pp_ranks`).

Data parallel: gradients reduced in fp32 (Megatron-LM's default under --bf16; torchtitan's
reduce dtype), parameters gathered in bf16, over the dp x cp GPUs that hold the same shard;
NCCL's model on the fabric that group sees (`tplab.cost.data_parallel.dp_group_hardware`).
FSDP without PP reshards after forward (torchtitan's default), with PP it does not (Llama 3,
torchtitan's PP default).

Memory headroom (each an assumption, stated): activation and transient memory x
(1 + FRAGMENTATION) for the caching allocator's fragmentation, NCCL_RESERVE for NCCL's
buffers (and NVLS's), plus `Hardware.memory_reserve` (CUDA context, cuBLAS workspaces).
A run with `expandable_segments` counts no fragmentation: torch's allocator, before it
raises out-of-memory, frees its cached blocks and retries (CUDACachingAllocator.cpp,
`malloc`: `release_available_cached_blocks`, then `release_cached_blocks`), and with
expandable segments that includes the free pages between live blocks, which it unmaps
(`release_expandable_segment`, `unmap_block`): Megatron-Bridge sets it for the recipes
that otherwise hit "allocator fragmentation OOM" ("expandable_segments lets the allocator
reclaim fragmented physical memory", scripts/performance/perf_plugins.py at v0.4.0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tplab.cost.collectives import collective_time
from tplab.cost.data_parallel import dp_group_hardware, gather_copy_seconds, sync_seconds
from tplab.cost.hardware import GiB
from tplab.cost.kernels import local_params
from tplab.cost.megatron_ranks import chunk_layers, rank_params, rank_peak_layers
from tplab.cost.memory import (
    OPTIMIZER_BYTES,
    PARAM_BYTES,
    ZERO_STAGES,
    Saved,
    layer_saved,
    mpt_layer,
    op_sac_layer,
    state_bytes,
)
from tplab.cost.pp_ranks import StageBytes, most_held, torchtitan_split
from tplab.cost.stacks import ZERO3_PREFETCH_ELEMENTS

PARAM = PARAM_BYTES["mixed"]
FP8_PARAM_BYTES = 1
"""Bytes a parameter is all-gathered in by the distributed optimizer under fp8 where the
stack holds fp8 primary weights (`Stack.fp8_params`: NeMo 2's `fp8_params = True`,
Megatron-Bridge's `fp8_param_gather = True`; the stacks module cites them)."""
STATES = OPTIMIZER_BYTES["adam"]["mixed"]
"""Bytes per parameter of a run (Megatron-LM's bf16 recipe, `tplab.cost.memory`'s "mixed"
with Adam: bf16 parameters, fp32 master and moments; the gradients' bytes are the stack's,
`Stack.grad_bytes`: fp32, or bf16 as "mixed_bf16_grads"), the same constants
`cost.gpu_memory` and `cost.dp_collectives` use; a fully sharded run's states are
`memory.state_bytes`'s (its fp32 shard is the master, `memory.MASTER_IS_SHARD`)."""
FRAGMENTATION = 0.10
NCCL_RESERVE = 1 * GiB


def check_stages(layers: int, pp: int, vpp: int) -> None:
    """Layers per stage: L or L + 2 (embedding and head as layers) divides by p x v."""
    slots = pp * vpp
    if pp > 1 and layers % slots and (layers + 2) % slots:
        raise ValueError(f"layers per stage: {layers} layers (or {layers + 2} with the "
                         f"embedding and LM head counted as layers) do not divide into "
                         f"pp x vpp = {slots} stages")


@dataclass(frozen=True)
class Stage:
    """The slowest pipeline stage: its seconds on one micro-batch and its layers."""

    slowest_s: float
    layers: int


@dataclass(frozen=True)
class Schedule:
    """One step's pipeline terms: compute, bubble and exposed P2P seconds."""

    compute_s: float
    bubble_s: float
    p2p_s: float


@dataclass(frozen=True)
class DataParallel:
    """One step's data-parallel traffic (`comm_s`) and what the compute does not hide."""

    comm_s: float
    exposed_s: float


def stage_time(layers: int, pp: int, vpp: int, per_layer: float, head: float) -> Stage:
    """Seconds the slowest pipeline stage spends on one micro-batch, and its layers."""
    if pp == 1:
        return Stage(layers * per_layer + head, layers)
    if layers % (pp * vpp) == 0:
        per_stage = layers // pp
        return Stage(per_stage * per_layer + head, per_stage)
    slots = (layers + 2) // pp
    middle, last = slots * per_layer, (slots - 1) * per_layer + head
    return Stage(max(middle, last), slots)


def p2p_time(shape, tp: int, cp: int, hw) -> float:
    """Seconds of one stage-to-stage send of a micro-batch's activations on one rank."""
    nbytes = shape.tokens // cp * shape.hidden * shape.dtype_bytes / tp
    crosses = tp * cp >= hw.gpus_per_node
    link = hw.inter if crosses else hw.intra
    return link.base_latency + link.latency + nbytes / link.bandwidth


def schedule(slowest: float, pp: int, vpp: int, m: int, p2p: float,
             overlap: bool = True) -> Schedule:
    """Compute, bubble and exposed P2P seconds of one step (module doc); `overlap` False:
    the interleaved schedule waits on every transfer (module doc)."""
    if pp == 1:
        return Schedule(m * slowest, 0.0, 0.0)
    if vpp == 1:
        exposed = 2 * m * p2p
    elif overlap:
        exposed = 2 * (pp - 1) * p2p
    else:   # warm-up, m v steady-state exchanges, cool-down
        exposed = (m * vpp + 2 * (pp - 1) + (vpp - 1) * pp) * p2p
    return Schedule(m * slowest, (pp - 1) / vpp * slowest, exposed)


def comm_share(stage: Stage, lt) -> float:
    """Seconds of a stage's micro-batch that are exposed TP and CP communication."""
    return stage.layers * (lt.tp_exposed_s + lt.cp_exposed_s)


def data_parallel(run, stage: Stage, lt, m: int) -> DataParallel:
    """The step's DP traffic and what the compute does not hide (`lt`: the run's
    `training_run.LayerTimes`)."""
    shape, hw, tp, cp = run.shape, run.hw, run.tp, run.cp
    group = run.dp * cp
    if group == 1:
        return DataParallel(0.0, 0.0)
    n = local_params(shape, tp, run.pp)
    view = dp_group_hardware(hw, tp * cp)
    fwd = stage.layers * lt.forward_s
    bwd = stage.layers * lt.backward_s
    shard = group
    if run.sharding == "hsdp":
        shard = min(group, max(1, hw.gpus_per_node // (tp * cp)))

    def t(op, nbytes, size=shard):
        return collective_time(op, nbytes, size, view, "auto") if size > 1 else 0.0

    grad = run.settings.grad_bytes
    # fp8 primary weights gathered as fp8 (Stack.fp8_params, fp8_param_gather)
    fp8_params = run.precision == "fp8" and run.settings.fp8_params
    param = FP8_PARAM_BYTES if fp8_params else PARAM
    rs, ag = t("reduce_scatter", grad * n), t("all_gather", param * n)
    ar = t("all_reduce", grad * n) if run.sharding == "ddp" else 0.0
    # the rule dp_times uses (data_parallel.sync_seconds); grad_overlap=False: reduced
    # after the last backward, gathered after the step; FSDP without PP reshards after
    # forward and gathers again for backward; fsdp_exposed: every micro-batch in the open
    comm, exposed = sync_seconds(
        ZERO_STAGES[run.sharding], ar, rs, ag, fwd, bwd, m,
        overlap=run.grad_overlap or run.sharding not in ("ddp", "zero1"),
        waits=run.settings.fsdp_exposed, gathers=1 if run.pp > 1 else 2)
    if run.sharding == "hsdp" and group > shard:
        ar = t("all_reduce", grad * n / shard, group // shard)
        comm, exposed = comm + ar, exposed + max(0.0, ar - bwd)
    copies = {3: m * (1 if run.pp > 1 else 2), 1: 1}.get(ZERO_STAGES[run.sharding], 0)
    if run.settings.gather_copy:   # FSDP2's copy-out, on the compute stream
        fp8 = linear_elements(run) * stage.layers if run.precision == "fp8" and \
            run.settings.fp8_gathers else 0.0
        exposed += copies * gather_copy_seconds(n, min(fp8, n), hw)
    return DataParallel(comm, exposed)


def in_flight(pp: int, vpp: int, m: int) -> float:
    """Micro-batches of activations the first stage holds at its peak: 1F1B's min(p, m);
    interleaved, p + (p - 1) / v (its warm-up, (v - 1) p + 2 (p - 1) chunk-forwards, and
    one more, each 1/v of the stage), and never more than the m micro-batches there are:
    both schedules cap the warm-up at all m v chunk-forwards (Megatron-LM's
    megatron/core/pipeline_parallel/schedules.py `get_pp_rank_microbatches` at d98e8a64:
    "if num_warmup_microbatches >= total_num_microbatches: num_warmup_microbatches =
    total_num_microbatches; are_all_microbatches_in_warmup = True"; torch's
    `ScheduleInterleaved1F1B` `get_rank_warmup_ops`, "We cannot have more warmup operations
    than there are number of microbatches, so cap it there"). The warm-up's p is a round of
    micro-batches: Megatron-LM's `microbatch_group_size_per_vp_stage` (default p), torch's
    `microbatches_per_round`, m / max(1, m // p) (torch 2.6-2.8), larger than p where p does
    not divide m; `check_rules` asks that it does, so both are p here. A second reader
    replayed torch's schedule and counted the same (p 16, v 4, m 128: 19.75; m 16: 16;
    p 8, v 2, m 8: 8)."""
    if pp == 1:
        return 1.0
    return min(m, pp + (pp - 1) / vpp) if vpp > 1 else min(pp, m)


def embedding_split(run) -> bool:
    """Whether the run's stack splits L + 2 layers over the pipeline (`Stack.embedding_slot`:
    the layers do not divide into p x v chunks, L + 2 do)."""
    layers, slots = run.shape.layers, run.pp * run.vpp
    return (run.settings.embedding_slot and run.pp > 1 and layers % slots != 0
            and (layers + 2) % slots == 0)


def held_layers(run) -> tuple[float, int | None]:
    """Layer-micro-batches of activations the most loaded rank holds, and that rank: the
    first stage's `ceil(L / p) x in_flight` (rank None: the model's average stage), or,
    under `embedding_split`, the most loaded of ranks 0, 1 and p - 1 as Megatron's schedule
    fills them (`rank_peak_layers`; ranks 1 to p - 2 hold full chunks, fewer of them the
    later the rank)."""
    layers, pp, vpp, m = run.shape.layers, run.pp, run.vpp, run.micro_batches
    if not embedding_split(run):
        return -(-layers // pp) * in_flight(pp, vpp, m), None
    held, rank = max((rank_peak_layers(layers, pp, vpp, m, r), r) for r in {0, 1, pp - 1})
    return held, rank


def fp8_param_saving(run, rank: int | None = None) -> float:
    """Bytes fp8 primary weights (`Stack.fp8_params`: `fp8_param_gather`) save against
    bf16 on pipeline rank `rank` (None: the average stage): the blocks' matrices are TE
    Float8Tensors, 1 byte, where fp8 GEMMs take any layout (`Hardware.fp8_any_layout`: TE
    makes no transposed copy on compute capability 10.x, csrc/quantizer.cpp at 5671fd36;
    Hopper keeps data and transpose, 2); Megatron's DDP buffer holds them as uint8
    (distributed_data_parallel.py at b0cc2706). Norms and embedding stay bf16; not under
    full sharding (Megatron-FSDP is not read)."""
    shape = run.shape
    if not (run.precision == "fp8" and run.settings.fp8_params and run.hw.fp8_any_layout
            and ZERO_STAGES[run.sharding] < 3):
        return 0.0
    built = (shape.layers / run.pp if rank is None else
             sum(chunk_layers(shape.layers, run.pp, run.vpp, rank, c) for c in range(run.vpp)))
    return built * linear_elements(run) * (PARAM - 1)


def layer_bytes(run, local, recompute: str) -> float:
    """Activation bytes one layer keeps per micro-batch on one rank: Megatron-LM's fused
    block for gated shapes, the paper's GPT layer otherwise, MPT's block where the stack
    runs it (`Stack.block`), each TP region's input as the stack keeps it under SP
    (`Stack.sp_saves`; `tplab.cost.memory`); under
    fp8 the linears' saved inputs are their 1-byte fp8 copies (Transformer Engine keeps
    the quantised input for the weight gradient)."""
    if recompute == "op":
        items = op_sac_layer(local)
        return sum(i.local_bytes(local.tokens, run.tp, run.tp > 1) for i in items)
    if run.settings.block == "mpt" and recompute != "full":   # flash: nothing to drop
        items = mpt_layer(local)
    else:
        opts = ({"norm": "fused", "swiglu": "fused"} if local.gated else {})
        items = layer_saved(local, recompute, "tplab" if local.gated else "gpt",
                            sp_saves=run.settings.sp_saves, **opts)
    if run.precision == "fp8":
        items = [replace(i, element_bytes=1) if i.linear_input else i for i in items]
        if run.settings.te_fp8 and local.gated and recompute != "full":
            items = te_fp8_saves(items, local)
    return sum(i.local_bytes(local.tokens, run.tp, run.tp > 1) for i in items)


def te_fp8_saves(items: list, shape) -> list:
    """Megatron's fused block under Transformer Engine fp8 (`Stack.te_fp8`): TE's `Linear`
    keeps for the weight gradient its own input quantised, 1 byte an element (
    transformer_engine/pytorch/module/linear.py at TE 5671fd36, 2.12, the version
    Megatron-Bridge v0.3.0 pins: `saved_inputmat = inputmat`, the quantised input, column-wise
    data only). So FC2 keeps the SwiGLU output in fp8, and no bf16 copy stays: Megatron's
    `bias_swiglu_impl` (megatron/core/fusions/fused_bias_swiglu.py) keeps only its input,
    `activation_func_fp8_input_store` False (transformer_config.py at b0cc2706, not set by
    Megatron-Bridge's recipes); and the output projection keeps an fp8 copy of the attention
    output beside the bf16 one the attention kernel keeps for its own backward."""
    out = [replace(i, element_bytes=1) if i.module.endswith("feed_forward.w2") else i
           for i in items]
    return out + [Saved("attention.wo", "input (fp8 copy)", shape.hidden, 1, tp=True)]


def gathered_elements(run, per_layer: float) -> float:
    """Parameter elements a fully sharded rank holds gathered at once (`Stack.gathers`):
    the layer in use and the prefetched one, or (DeepSpeed 2021's ZeRO-3) the largest
    weight matrix of a layer and the prefetch bucket."""
    if run.settings.gathers == "layer":
        return 2 * per_layer
    h, f, kv = run.shape.hidden, run.shape.ffn_size, run.shape.kv_dim
    largest = max(h * (h + 2 * kv), (2 if run.shape.gated else 1) * h * f) / run.tp
    return largest + ZERO3_PREFETCH_ELEMENTS


def torch_cp_backward_bytes(run) -> float:
    """Bytes torch's `context_parallel` holds in one attention backward beyond what plain
    flash attention does (cp > 1, `Stack.torch_cp`), read in
    torch/distributed/tensor/experimental/_attention.py `_templated_ring_attention_backward`
    (torch 2.6-2.8) with the "allgather" rotate method (torchtitan's default at 9dec370,
    config_manager.py `--experimental.context_parallel_rotate_method`): K and V all-gathered
    whole in bf16 (`_AllGatherRotater`, one gather of every shard), 4 cp E bytes, and at
    the dK/dV exchange, all alive at once: fp32 gradient buffers (`convert_to_f32`), dq's
    accumulator 4 E, the received dK/dV 8 E, dK/dV concatenated for the next all-to-all
    8 E, that all-to-all's output 8 E and `_partial_update`'s fresh dK/dV copies 8 E, with
    the bf16 K/V concatenation `next_kv` 4 E: 40 E (a second reader's count, replayed with
    every storage tracked; the first count, 28 E, missed the copies and `next_kv`).
    E is one of q, k, v on a rank: torchtitan's Attention repeats K and V to every query
    head (`repeat_kv`) before SDPA, so all three are tokens x heads / tp x head width."""
    if not (run.settings.torch_cp and run.cp > 1):
        return 0.0
    shape = run.shape
    e = shape.batch * (shape.seq // run.cp) * shape.hidden / run.tp
    return 4 * run.cp * e + 40 * e


def linear_elements(run) -> float:
    """Weight elements of one layer's linears on one GPU (1/t of wq, wk, wv, wo and the
    MLP's), the weights torchao's Float8Linear all-gathers in fp8 under FSDP
    (`Stack.fp8_gathers`)."""
    h, f, kv = run.shape.hidden, run.shape.ffn_size, run.shape.kv_dim
    return (h * (h + 2 * kv) + h * h + (3 if run.shape.gated else 2) * h * f) / run.tp


def torch_stage_peak(run, local, layer: float, backward: float, per_logit: int):
    """The largest rank's peak under torch.distributed.pipelining (`tplab.cost.pp_ranks`):
    `layer`, one layer's saved bytes per micro-batch; `backward`, a layer's transient in
    backward; `per_logit`, the loss's bytes a logit at its backward."""
    shape, tp = run.shape, run.tp
    io = local.tokens * shape.hidden * shape.dtype_bytes / tp
    gathered = tp if run.settings.sp_saves == "gathered" else 1
    vocab = local.tokens * -(-shape.vocab // tp) if shape.vocab else 0
    split = torchtitan_split(shape.layers, run.pp * run.vpp)
    stage = StageBytes(layer=layer, io=io, head=io + gathered * io,
                       logits=shape.dtype_bytes * vocab, loss_saved=4 * vocab,
                       loss_peak=per_logit * vocab, backward=backward)
    return most_held(split, run.pp, run.vpp, run.micro_batches, stage)


def memory(run) -> dict:
    """Bytes per GPU on the first (most loaded) stage, by kind (module doc)."""
    shape, hw, tp, cp = run.shape, run.hw, run.tp, run.cp
    held, rank = held_layers(run)
    n = rank_params(run, rank)
    group = run.dp * cp
    shard = {"ddp": 1, "hsdp": min(group, max(1, hw.gpus_per_node // (tp * cp)))}.get(
        run.sharding, group)
    precision = "mixed_bf16_grads" if run.settings.grad_bytes == 2 else "mixed"
    states = state_bytes(n, ZERO_STAGES[run.sharding], shard, precision)   # gpu_memory's
    local = shape.with_(seq=shape.seq // cp)
    # flash attention keeps no s x s scores: what "selective" drops is never saved;
    # "op" keeps what torchtitan's op-level SAC saves (memory.op_sac_layer);
    # "half_layers" half of "none", half of "full"
    kept = run.recompute
    if run.attention == "flash" and kept == "none":
        kept = "selective"
    if kept == "half_layers":
        layer = (layer_bytes(run, local, "full")
                 + layer_bytes(run, local, "selective" if run.attention == "flash" else "none")) / 2
    else:
        layer = layer_bytes(run, local, kept)
    layers = -(-shape.layers // run.pp)
    acts = held * layer
    states["param_bytes"] -= fp8_param_saving(run, rank)
    transient = 0.0
    if run.recompute in ("full", "half_layers", "op"):   # one layer's, rebuilt for backward
        transient += layer_bytes(run, local, "selective" if run.attention == "flash"
                                 else "none")
    fp8 = run.precision == "fp8" and run.settings.fp8_gathers
    if run.sharding in ("fsdp", "hsdp"):
        gathered = gathered_elements(run, n / layers)
        transient += PARAM * gathered - (PARAM - 1) * min(
            gathered, 2 * linear_elements(run) if fp8 else 0.0)
    if fp8 and run.pp > 1 and run.sharding == "zero1":   # FSDP under PP: kept gathered
        states["param_bytes"] -= (PARAM - 1) * linear_elements(run) * shape.layers / run.pp
    # the fp32 logits and their gradient live on the last stage, counted when it is also
    # the first (pp = 1); with pp > 1 the first stage's in-flight activations dominate
    per_logit = ((tp > 1 and run.settings.tp_logits_bytes) or run.settings.logits_bytes)
    logits = (per_logit * local.tokens * -(-shape.vocab // tp)
              if shape.vocab and run.pp == 1 else 0.0)
    # torch's ring-attention buffers live inside one attention backward, the loss's before
    # the first layer's backward starts: never at once, so the larger of the two counts
    transient += max(0.0, torch_cp_backward_bytes(run) - logits)
    if run.pp > 1 and run.settings.pipelining == "torch":
        peak = torch_stage_peak(run, local, layer, transient, per_logit)
        acts, logits, transient = peak.activations, peak.logits, peak.transient
    slack = 0.0 if run.expandable_segments else FRAGMENTATION
    headroom = slack * (acts + transient + logits) + NCCL_RESERVE + hw.memory_reserve
    out = states | {"activation_bytes": acts, "transient_bytes": transient,
                    "logits_bytes": logits, "headroom_bytes": headroom}
    out["total_bytes"] = sum(out.values())
    return out
