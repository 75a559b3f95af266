"""A whole training run on paper: `TrainingRun` (a model on `gpus` GPUs in a (TP, PP, CP, DP)
layout) and `predict(run)`, its step time, tokens per second per GPU, end-to-end MFU and
memory per GPU, checked against published runs (`tplab.cost.published`, docs/VALIDATION.md).

How a step is priced (one set of constants per hardware preset, each cited where defined):

- **GEMMs** at a kernel rate: peak x `Hardware.matmul_efficiency` (mamf-finder's measured
  maximum, `tplab.cost.hardware`) x `Hardware.sustained` (the fraction of that burst a GPU
  holds at its power cap, mamf-finder's MSMF) x the shape's tile quantisation, or the memory
  roofline (bytes / bandwidth) if that is slower: one roofline, applied once
  (`tplab.cost.kernels`). fp8 runs the linears at `fp8_flops` x `fp8_matmul_efficiency`,
  plus the quantisation of their operands at the memory bandwidth (`kernels.fp8_cast_bytes`).
- **Attention**: flash attention (causal: half of 4 b s^2 h) at
  `Hardware.attention_efficiency`, its backward 2.5 x the forward's FLOPs (it recomputes the
  scores), or materialised scores (`attention="unfused"`: batched GEMMs and softmax bytes).
- **Element-wise work** (norms, RoPE, SwiGLU/GELU, residuals, the loss) as bytes over the
  memory bandwidth, fused (Megatron-LM) or eager (PyTorch) (`kernels.elementwise_bytes`).
- **TP**: the block's collectives (`tplab.cost.transformer.block_collectives`, sequence
  parallel, Megatron-LM's layout) priced by NCCL's model; the input-gradient collectives
  hide behind the weight-gradient GEMMs (Megatron-LM's overlap; `tp_overlap=False`: not),
  the rest is exposed.
- **PP** (`tplab.cost.pipeline`): 1F1B or interleaved, the bubble (p-1)/(v m), P2P, the
  slowest stage (embedding and LM head), the first stage's in-flight activations.
- **CP**: all-gather of K and V (and reduce-scatter of their gradients), load balanced.
- **DP / sharding**: gradient reduce-scatter (or all-reduce) and parameter all-gather over
  the DP x CP group, behind the backward and forward passes where they fit;
  "zero2"/"fsdp"/"hsdp" reduce-scatter every micro-batch, "fsdp"/"hsdp" also gather the
  parameters every micro-batch (HSDP shards inside the node and all-reduces across). With
  `grad_overlap=False` the step-end reduction of "ddp" and "zero1" (and ZeRO-1's gather) is
  all exposed.
- **Recomputation**: "full" re-runs the forward; "selective" re-runs the attention core
  (Korthikanti et al. 2022's selective recomputation). Two more, torchtitan's
  (torchtitan/parallelisms/parallelize_llama.py at 9dec370, `_apply_ac_to_transformer_block`):
  "op", its op-level SAC, saves the outputs of every other matmul (counted from the first)
  and of attention (`memory.op_sac_layer`), so it re-runs the other matmuls (wk, wo and w3
  or fc2: `kernels.op_sac_recomputed_gemms`) and every element-wise op of the forward;
  "half_layers", its layer-level
  selective AC at frequency 2, re-runs the whole forward of every second layer.
- The optimizer step: Adam reads 16 and writes 12 bytes per local parameter (fp32 master,
  m, v, grad), and the rest of the step (the gradient norm, Megatron-LM's copy into the
  bf16 weights and its zeroing of the gradient buffer) moves `kernels.OPTIMIZER_EXTRA`
  more, at the memory bandwidth (torchtitan's foreach AdamW: `Stack.optimizer`).

MFU (`Prediction.mfu`) is end to end: the model's FLOPs (6 N per token plus causal
attention, no recomputation) over the step time x peak, communication and bubbles included.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tplab.cost import attention_rates, kernels, pipeline
from tplab.cost.collectives import collective_time
from tplab.cost.data_parallel import dp_group_hardware
from tplab.cost.hardware import HARDWARE, Hardware
from tplab.cost.shapes import MODELS, BlockShape
from tplab.cost.stacks import (
    ATTENTIONS,
    DEFAULT_STACK,
    FP8_RECIPES,
    KERNELS,
    STACKS,
    Stack,
    get_stack,
)
from tplab.cost.transformer import block_collectives, tp_allowed
from tplab.cost.validate import (
    check_bool,
    check_choice,
    check_int,
    check_type,
)

PRECISIONS = ("bf16", "fp8")
RECOMPUTES = ("none", "selective", "full", "op", "half_layers")
SHARDINGS = ("ddp", "zero1", "zero2", "fsdp", "hsdp")


@dataclass(frozen=True)
class TrainingRun:
    """One training run: `model` (a `MODELS` name or a `BlockShape`) on `gpus` GPUs of
    `hardware` (a `HARDWARE` name or a `Hardware`), gpus = tp x pp x cp x dp; see the
    module doc. `global_batch` and `micro_batch` are in sequences of `seq_len` tokens.
    `stack` (a `cost.STACKS` name, default `DEFAULT_STACK`, "megatron-lm") is the software
    that runs it (`tplab.cost.stacks`): it sets the fields below, which a run may override.
    `kernels` ("fused": Megatron-LM / Transformer Engine; "eager": PyTorch eager) and
    `attention` ("flash"; "unfused": materialised scores) say how the framework runs the
    layer (`tplab.cost.kernels`). `grad_overlap` False ("ddp" and "zero1"): the framework
    reduces the gradients (and, under ZeRO-1, gathers the parameters) after the last
    backward pass, not behind it (Megatron-LM before its 2023 `overlap_grad_reduce`).
    `tp_overlap` False: the backward's input-gradient collectives wait (no async all-reduce
    behind the weight-gradient GEMM: Megatron-LM before September 2021). `torch_cp`: context
    parallelism as torch's `context_parallel` runs it (`cp_exposed`). `p2p_overlap` False:
    the interleaved schedule waits on its stage-to-stage transfers (`pipeline` module doc:
    Megatron-LM before 2023). `grad_bytes` (4 or 2): the gradient buffer's bytes per
    parameter, fp32 or reduced in bf16 (`Stack.grad_bytes`). `fp8_recipe`: how fp8
    quantises (`Stack.fp8_recipe`: "unfused", "te-delayed", "te-current").
    `expandable_segments` True: the run sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`,
    so the caching allocator can unmap the free pages between live blocks when memory runs
    short, and the memory it needs counts no fragmentation slack (`pipeline.memory`)."""

    model: str | BlockShape
    hardware: str | Hardware
    gpus: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str = "bf16"
    recompute: str = "none"
    sharding: str = "zero1"
    gpus_per_node: int | None = None
    nics_per_node: int | None = None
    stack: str = DEFAULT_STACK
    kernels: str | None = None
    attention: str | None = None
    grad_overlap: bool | None = None
    tp_overlap: bool | None = None
    torch_cp: bool | None = None
    p2p_overlap: bool | None = None
    grad_bytes: int | None = None
    attention_kernel: str | None = None
    fp8_recipe: str | None = None
    expandable_segments: bool = False
    shape: BlockShape = field(init=False, repr=False)
    hw: Hardware = field(init=False, repr=False)
    settings: Stack = field(init=False, repr=False)

    def __post_init__(self):
        shape = MODELS.get(self.model) if isinstance(self.model, str) else self.model
        if shape is None:
            raise ValueError(f"model = {self.model!r} is not in cost.MODELS "
                             f"({', '.join(MODELS)}); pass a BlockShape instead")
        check_type("model", shape, BlockShape, "a cost.MODELS name or a BlockShape")
        hw = HARDWARE.get(self.hardware) if isinstance(self.hardware, str) else self.hardware
        if hw is None:
            raise ValueError(f"hardware = {self.hardware!r} is not in cost.HARDWARE "
                             f"({', '.join(HARDWARE)})")
        check_type("hardware", hw, Hardware, "a cost.HARDWARE name or a Hardware")
        for name in ("gpus", "tp", "pp", "vpp", "cp", "ep", "micro_batch"):
            check_int(name, getattr(self, name))
        changes = {k: v for k, v in (("gpus_per_node", self.gpus_per_node),
                                     ("nics_per_node", self.nics_per_node)) if v is not None}
        hw = hw.with_(**changes) if changes else hw
        seq = self.seq_len if self.seq_len is not None else shape.seq
        check_int("seq_len", seq)
        shape = shape.with_(seq=seq, batch=self.micro_batch)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "hw", hw)
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.micro_batch * self.dp)
        check_int("global_batch", self.global_batch)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("recompute", self.recompute, RECOMPUTES)
        check_choice("sharding", self.sharding, SHARDINGS)
        check_bool("expandable_segments", self.expandable_segments)
        resolve_stack(self)
        check_rules(self)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batches(self) -> int:
        """m: micro-batches per DP replica per optimizer step."""
        return self.global_batch // (self.micro_batch * self.dp)


OVERRIDES = ("kernels", "attention", "grad_overlap", "tp_overlap", "torch_cp", "p2p_overlap",
             "grad_bytes", "attention_kernel", "fp8_recipe")


def resolve_stack(run: TrainingRun) -> None:
    """`run.settings`: the named stack (`tplab.cost.stacks`) with the fields the run sets
    itself; each of those fields then holds the value priced."""
    if not isinstance(run.stack, str):
        raise ValueError(f"stack = {run.stack!r}: expected a cost.STACKS name "
                         f"({', '.join(STACKS)})")
    base = get_stack(run.stack)
    changes = {k: getattr(run, k) for k in OVERRIDES if getattr(run, k) is not None}
    if "kernels" in changes:
        check_choice("kernels", changes["kernels"], KERNELS)
    if "attention" in changes:
        check_choice("attention", changes["attention"], ATTENTIONS)
    if "attention_kernel" in changes:
        check_choice("attention_kernel", changes["attention_kernel"], attention_rates.KERNELS)
    for k in ("grad_overlap", "tp_overlap", "torch_cp", "p2p_overlap"):
        if k in changes:
            check_bool(k, changes[k])
    if "fp8_recipe" in changes:
        check_choice("fp8_recipe", changes["fp8_recipe"], FP8_RECIPES)
    if "grad_bytes" in changes and changes["grad_bytes"] not in (2, 4):
        raise ValueError(f"grad_bytes = {changes['grad_bytes']!r}: expected 4 (fp32 "
                         "gradients) or 2 (reduced in bf16)")
    settings = replace(base, **changes) if changes else base
    object.__setattr__(run, "settings", settings)
    for k in OVERRIDES:
        object.__setattr__(run, k, getattr(settings, k))


def check_rules(run: TrainingRun) -> None:
    """The rules a framework enforces, each a ValueError that names it."""
    shape, hw = run.shape, run.hw
    if run.gpus % (run.tp * run.pp * run.cp):
        raise ValueError(f"gpus = {run.gpus} is not tp x pp x cp x dp: tp {run.tp} x pp "
                         f"{run.pp} x cp {run.cp} = {run.tp * run.pp * run.cp} does not "
                         "divide it")
    why = tp_allowed(shape, run.tp)
    if why:
        raise ValueError(f"tp = {run.tp}: {why}")
    if run.ep != 1:
        raise ValueError("ep must be 1: tplab prices dense models only (no experts)")
    if run.vpp > 1 and run.pp == 1:
        raise ValueError(f"vpp = {run.vpp} needs pp > 1: interleaving splits pipeline stages")
    pipeline.check_stages(shape.layers, run.pp, run.vpp)
    if run.global_batch % (run.micro_batch * run.dp):
        raise ValueError(f"global_batch = {run.global_batch} is not micro_batch x dp x "
                         f"micro-batches: micro_batch {run.micro_batch} x dp {run.dp} does "
                         "not divide it")
    if run.vpp > 1 and run.micro_batches % run.pp:
        raise ValueError(f"the interleaved schedule needs the micro-batches per step "
                         f"({run.micro_batches}) to be a multiple of pp = {run.pp} "
                         "(Megatron-LM's rule)")
    if run.cp > 1 and shape.seq % (2 * run.cp):
        raise ValueError(f"seq_len = {shape.seq} must divide into 2 x cp = {2 * run.cp} "
                         "chunks: load-balanced context parallelism gives each rank two")
    if run.precision == "fp8" and not hw.fp8_flops:
        raise ValueError(f"precision = 'fp8' needs fp8 Tensor Cores; {hw.name} has none "
                         "(Hardware.fp8_flops = 0)")
    if run.sharding == "hsdp" and run.dp % max(1, hw.gpus_per_node // (run.tp * run.cp)):
        raise ValueError(f"sharding = 'hsdp' shards inside a node: dp = {run.dp} must be a "
                         "multiple of the GPUs per node over tp x cp")


@dataclass(frozen=True)
class Prediction:
    """What `predict` returns; `breakdown` is seconds per optimizer step by cause."""

    run: TrainingRun
    stack: str
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_per_gpu: float
    fits: bool
    breakdown: dict
    memory: dict


def model_flops_per_token(shape: BlockShape) -> float:
    """Forward + backward FLOPs per token, no recomputation: 3 x (every layer's linears,
    2 x their weights, plus causal attention, 2 s h; the LM head, 2 h V). Chowdhery et
    al. 2022's MFU convention, with the causal half of the attention that flash attention
    computes."""
    layer = kernels.layer_linear_flops(shape) + 2 * shape.seq * shape.hidden
    return 3 * (shape.layers * layer + 2 * shape.hidden * shape.vocab)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one layer on one micro-batch on one GPU: forward and backward compute
    (recomputation included), the TP and CP collectives' exposed time, and the parts of
    the forward: its linear GEMMs, attention, element-wise work."""

    forward_s: float
    backward_s: float
    tp_exposed_s: float
    cp_exposed_s: float
    gemm_fwd_s: float
    attention_s: float
    elementwise_s: float


def layer_times(run: TrainingRun) -> LayerTimes:
    """The `LayerTimes` of `run` (module doc)."""
    shape, hw, tp, cp = run.shape, run.hw, run.tp, run.cp
    tokens = shape.tokens // cp
    fwd = kernels.linear_time(shape, tokens, tp, hw, run.precision)
    bwd_dgrad, bwd_wgrad = 2 * [fwd]
    fwd_rate, bwd_rate = attention_rates_of(run)
    attn_s = kernels.attention_time(shape, cp, tp, hw, run.attention, fwd_rate)
    attn_bwd = kernels.attention_backward(shape, cp, tp, hw, run.attention, bwd_rate)
    elem = kernels.elementwise_bytes(shape, tokens, tp, run.kernels) / hw.achievable_bandwidth
    cast = (0.0, 0.0)
    recipe = run.settings.fp8_recipe
    if run.precision == "fp8":   # the linears' operands quantised (kernels.fp8_cast_bytes)
        cast = tuple(b / hw.achievable_bandwidth
                     for b in kernels.fp8_cast_bytes(shape, tokens, tp, hw, recipe))
    in_fp8 = kernels.FP8_TP_ROLES[recipe] if run.precision == "fp8" else ()
    forward = fwd + attn_s + elem + cast[0]
    backward = bwd_dgrad + bwd_wgrad + attn_bwd + 2 * elem + cast[1]
    if run.recompute == "full":
        backward += forward
    elif run.recompute == "selective":
        backward += attn_s
    elif run.recompute == "op":       # every second mm and every element-wise op
        backward += elem + sum(kernels.gemm_time(m, n, k, hw, run.precision)
                               for m, n, k in kernels.op_sac_recomputed_gemms(shape, tokens, tp))
    elif run.recompute == "half_layers":
        backward += forward / 2
    local = shape.with_(seq=shape.seq // cp)
    exposed = 0.0
    for r in block_collectives(local, tp, True, sp_saves="shard") if tp > 1 else []:
        size = r["bytes"] / shape.dtype_bytes if r["role"] in in_fp8 else r["bytes"]
        t = collective_time(r["op"], size, tp, hw, "auto")
        hidden_by = bwd_wgrad / 2 if r["role"] == "bwd_in" and run.tp_overlap else 0.0
        again = {"full": 1.0, "half_layers": 0.5}.get(run.recompute, 0.0)
        exposed += max(0.0, t - hidden_by) * (1 + again * (r["phase"] == "forward"))
    cp_s = cp_exposed(run, attn_s, attn_bwd) if cp > 1 else 0.0
    return LayerTimes(forward, backward, exposed, cp_s, fwd, attn_s, elem)


def attention_rates_of(run: TrainingRun) -> tuple[float, float]:
    """(forward, backward) flash attention rate / peak on one rank: the stack's kernel
    (`Stack.attention_kernel`) at the call's micro-batch x heads and sequence where it was
    measured on the GPU's architecture (`tplab.cost.attention_rates`), else the preset's
    `attention_efficiency`; times the stack's `attention_scale` (its kernel class against
    FlashAttention-2)."""
    shape, hw, scale = run.shape, run.hw, run.settings.attention_scale
    if run.attention != "flash" or not attention_rates.measured(hw.arch):
        return hw.attention_efficiency * scale, hw.attention_efficiency * scale
    batch_heads, seq = shape.batch * max(1, shape.heads // run.tp), shape.seq // run.cp
    kernel = run.attention_kernel
    return (attention_rates.fraction(kernel, batch_heads, seq) * scale,
            attention_rates.fraction(kernel, batch_heads, seq, backward=True) * scale)


def cp_exposed(run: TrainingRun, attn_s: float, attn_bwd: float) -> float:
    """Exposed seconds of one layer's context-parallel K/V traffic on one micro-batch.
    Default: an all-gather of K and V behind half the forward attention, a reduce-scatter
    of dK, dV behind the forward attention's time in backward. `torch_cp`: torch's
    `context_parallel`, which torchtitan runs (torch/distributed/tensor/experimental/
    _attention.py): K and V carry every query head (torchtitan's model calls `repeat_kv`
    before SDPA), are all-gathered once and waited for after the first of cp sub-SDPA
    calls ("all-gather all kv shards on ranks after the first sub-SDPA computation",
    torchtitan's `context_parallel_rotate_method` help), forward, in the recomputed
    forward under full recomputation, and again in backward, where dK and dV pass to the
    next rank in fp32 after every sub-SDPA backward (`_AllToAllRotater`, accumulated in
    float32), each behind the next one."""
    shape, hw, tp, cp = run.shape, run.hw, run.tp, run.cp
    view = dp_group_hardware(hw, tp)
    if not run.torch_cp:
        kv = 2 * shape.batch * shape.seq * shape.kv_dim * shape.dtype_bytes / max(
            1, tp // max(1, min(tp, shape.kv_heads or shape.heads)))
        ag = collective_time("all_gather", kv / tp, cp, view, "auto")
        return max(0.0, ag - attn_s / 2) + max(0.0, ag - attn_s)
    kv = 2 * shape.batch * shape.seq * shape.hidden / tp * shape.dtype_bytes   # all heads
    ag = collective_time("all_gather", kv, cp, view, "auto")
    forward = max(0.0, ag - attn_s / cp) * (2 if run.recompute == "full" else 1)
    dkv = collective_time("send", 2 * kv / cp, 2, view, "auto")   # fp32, to the next rank
    backward = max(0.0, ag - attn_bwd / cp) + (cp - 1) * max(0.0, dkv - attn_bwd / cp) + dkv
    return forward + backward


def predict(run: TrainingRun) -> Prediction:
    """The step of `run`: see the module doc."""
    check_type("run", run, TrainingRun, "a cost.TrainingRun")
    shape, hw = run.shape, run.hw
    lt = layer_times(run)
    per_layer = lt.forward_s + lt.backward_s + lt.tp_exposed_s + lt.cp_exposed_s
    head = kernels.head_time(shape, shape.tokens // run.cp, run.tp, hw, run.precision)
    stage = pipeline.stage_time(shape.layers, run.pp, run.vpp, per_layer, head)
    m = run.micro_batches
    p2p = pipeline.p2p_time(shape, run.tp, run.cp, hw)
    pipe = pipeline.schedule(stage.slowest_s, run.pp, run.vpp, m, p2p, run.p2p_overlap)
    data = pipeline.data_parallel(run, stage, lt, m)
    optimizer = kernels.optimizer_time(shape, run.tp, run.pp, run.dp * run.cp, run.sharding,
                                       hw, run.settings.optimizer or run.kernels)
    step = pipe.compute_s + pipe.bubble_s + pipe.p2p_s + data.exposed_s + optimizer
    tokens = run.global_batch * shape.seq
    flops = model_flops_per_token(shape) * tokens
    compute = m * stage.slowest_s - m * pipeline.comm_share(stage, lt)
    breakdown = {"compute_s": compute, "tp_exposed_s": m * stage.layers * lt.tp_exposed_s,
                 "cp_exposed_s": m * stage.layers * lt.cp_exposed_s,
                 "pp_bubble_s": pipe.bubble_s, "pp_p2p_s": pipe.p2p_s,
                 "dp_exposed_s": data.exposed_s, "dp_comm_s": data.comm_s,
                 "optimizer_s": optimizer}
    memory = pipeline.memory(run)
    return Prediction(run=run, stack=run.stack, step_s=step,
                      tokens_per_s_per_gpu=tokens / (step * run.gpus),
                      mfu=flops / (step * run.gpus * peak_flops(run)),
                      memory_per_gpu=memory["total_bytes"],
                      fits=memory["total_bytes"] <= hw.memory, breakdown=breakdown,
                      memory=memory)


def peak_flops(run: TrainingRun) -> float:
    """The peak MFU divides by: the fp8 Tensor Cores' under precision="fp8" (the linears run
    there), else the bf16 peak (Chowdhery et al. 2022: achieved over the peak of the
    arithmetic the run uses)."""
    return run.hw.fp8_flops if run.precision == "fp8" else run.hw.flops
