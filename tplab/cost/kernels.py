"""The kernels of a training step on one GPU, timed: GEMMs at a measured kernel rate with one
roofline, element-wise work at the memory bandwidth, the LM head and loss, the optimizer.
Every memory-bound term runs at `Hardware.achievable_bandwidth` (the datasheet's x
`HBM_EFFICIENCY`, what a copy reaches; `tplab.cost.hardware`).

GEMM: time = GEMM_OVERHEAD + max(2 m n k / (peak x `matmul_efficiency` x `sustained` x tile
quantisation x k / (k + GEMM_K0)), bytes / memory bandwidth). `matmul_efficiency` is the
best rate mamf-finder measured for large GEMMs (`tplab.cost.hardware`), so it is a kernel
rate, not an end-to-end MFU, and a burst: `Hardware.sustained` is the fraction a GPU holds
at its power cap in a run (mamf-finder's MSMF; `gemm_time(..., sustained=False)` gives the
burst, which XLA's table below measures); the tile quantisation is NVIDIA's (Matrix Multiplication
Background guide: a dimension that is not a multiple of the 128 x 256 or 128 x 128 tile
pays for the whole last tile); k / (k + GEMM_K0) is the pipeline's fill over a short k and
GEMM_OVERHEAD the fixed cost of a call. Those two are fitted to XLA's published H100 GEMM
measurements (openxla/xla, tensorflow/tensorflow third_party/xla/xla/service/gpu/model/
matmul_interpolator_data.h, key "sm_90", bf16, b = 1: `GEMM_POINTS`), where the model's
median error is 5% (4% with m, n >= 1024, worst 7%); wave quantisation made it worse
(cuBLAS picks tiles and split-K to fill the SMs) and is left out. The memory roofline is
applied once, to the bytes the GEMM reads and writes. This is tplab's one GEMM model:
`gemm_efficiency` gives a shape's fraction of the large-GEMM rate in it, which
`step_time` applies to its `mfu`.

Element-wise bytes per token per layer, forward, 2-byte activations, by `kernels=`:

- "fused" (Megatron-LM with Transformer Engine: the norm fused into the next linear, fused
  RoPE, bias-SwiGLU/GELU and bias-dropout-add): two norms 2 x 4h, two residual adds 2 x 6h
  (split by t under sequence parallelism), RoPE 4 (h + h_kv) / t, SwiGLU 6f / t (GELU 4f /
  t): each op reads its inputs and writes its output once.
- "eager" (PyTorch eager, torchtitan's Llama: one kernel per op): RMSNorm in fp32 (cast,
  square, mean, multiply, cast back, weight: 36h each), RoPE through fp32 complex numbers
  (cast, complex multiply, cast back: 20 bytes per q and k element), the attention output's
  transpose copy (4h / t), SwiGLU as silu then multiply (10f / t; GELU 4f / t) and the two
  residual adds (12h). Gated MLPs only: a non-gated shape (GPT, MPT) has LayerNorm, which
  MPT runs in low precision in one kernel (4h), so it is priced as "fused".

The backward pass moves twice the forward's bytes. Under fp8 each linear's operands are
quantised (`fp8_cast_bytes`, by the stack's `fp8_recipe`: "unfused", FP8_CAST_BYTES per
element of every operand, weights included, plus the transposed copy Hopper's fp8 GEMMs
need; "te-delayed" and "te-current", what Transformer Engine's modules do, `te_cast_bytes`).
The loss reads and writes the fp32 logits: 12 bytes per logit.

Attention, by `attention=`: "flash" (FlashAttention: causal tiles skipped, half of
4 b s^2 h, at `Hardware.attention_efficiency`; its backward recomputes the scores, 5
matmuls to the forward's 2: FLASH_BACKWARD x the forward's FLOPs) or "unfused" (Megatron-LM
in 2022, Korthikanti et al. section 4.1: Q K^T and the product with V as batched GEMMs over
the full s x s scores, each priced by `gemm_time`, so Q K^T runs at its short k = head
width's rate; the backward's four gradient GEMMs likewise; and the softmax and dropout in
memory, SCORE_BYTES per score forward, twice that backward).
"""

from __future__ import annotations

import math

from tplab.cost.hardware import Hardware
from tplab.cost.memory import param_count
from tplab.cost.shapes import BlockShape
from tplab.cost.stacks import FP8_RECIPES
from tplab.cost.validate import check_int, check_type

TILES = ((128, 256), (128, 128))
GEMM_OVERHEAD = 6e-6
GEMM_K0 = 128
GEMM_POINTS = (   # (m, n, k, measured TFLOP/s): XLA's sm_90 bf16 table, b = 1 (module doc)
    (1024, 2048, 256, 139.519), (256, 2048, 256, 41.838), (4096, 512, 512, 238.822),
    (512, 256, 512, 21.789), (256, 2048, 4096, 285.874), (4096, 1024, 512, 343.707),
    (2048, 2048, 2048, 631.985), (256, 512, 4096, 91.679), (256, 1024, 256, 22.672),
    (4096, 4096, 256, 392.163), (512, 256, 4096, 91.057), (256, 1024, 4096, 172.295),
    (4096, 2048, 512, 447.020), (2048, 256, 1024, 135.848), (4096, 4096, 4096, 783.329),
    (512, 4096, 1024, 373.346), (2048, 512, 2048, 347.714), (1024, 256, 1024, 68.339),
    (4096, 256, 2048, 304.694), (1024, 1024, 2048, 349.981), (2048, 1024, 2048, 523.266),
    (1024, 512, 2048, 220.029), (256, 4096, 2048, 324.589), (512, 2048, 1024, 232.613),
    (4096, 512, 1024, 370.767), (1024, 2048, 2048, 524.288), (512, 256, 256, 11.460))
LOSS_BYTES = 12
FP8_CAST_BYTES = 5
"""Bytes per element of a tensorwise fp8 quantisation with current (dynamic) scaling: the
amax pass reads the bf16 tensor (2), the cast reads it again (2) and writes fp8 (1);
priced unfused with its producer (torchao's float8 tensorwise recipe, Transformer Engine's
current scaling; TE's LayerNormLinear, which writes the norm's output in fp8, moves less)."""
SCORE_BYTES = 9
"""Bytes per score the unfused softmax and dropout move beyond their GEMMs (which
`gemm_time` prices with their own reads and writes): the fused scale-mask-softmax reads
and writes 4, dropout reads 2, writes 2 and a 1-byte mask; backward twice that."""
FLASH_BACKWARD = 2.5
"""Flash attention's backward FLOPs over its forward's: it recomputes S = Q K^T and P, 5
matmuls to 2 (Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py, `flops`:
"2.5 * f" for mode "bwd"), the FLOP count its published TFLOP/s are measured against."""
ADAM_BYTES = 28
"""Bytes Adam moves per local parameter per step: reads fp32 master, m, v and gradient (16),
writes master, m and v (12)."""
OPTIMIZER_EXTRA = {"fused": 14, "eager": 4, "foreach": (80 - 28) + 12}
"""Bytes per local parameter the rest of the optimizer step moves, by `kernels=`. "fused"
(Megatron-LM, megatron/core/optimizer/optimizer.py): the gradient norm for clipping reads
the fp32 main gradients (4), `_copy_main_params_to_model_params` copies the fp32 master
weights into the bf16 model weights (`_multi_tensor_copy_this_to_that`: read 4, write 2)
and the fp32 gradient buffer is zeroed for the next step (4). "eager" (PyTorch FSDP2 with
torch.optim.AdamW, torchtitan): the gradient norm reads the fp32 sharded gradients (4); the
sharded parameters are the fp32 master, cast to bf16 when gathered, and the gradients are
freed (`zero_grad(set_to_none=True)`), not zeroed. "foreach" (`Stack.optimizer`,
torchtitan: torch.optim.AdamW with foreach=True on FSDP2's fp32 shards): `_multi_tensor_adamw`
(torch/optim/adamw.py, read at 002d2f0b; the version torchtitan's tables ran, 1963fc8, is
not stored here) makes eight passes, each reading and writing whole fp32 tensors: the
decay `_foreach_mul_` of the parameters (read 4, write 4), `_foreach_lerp_` of m toward the
gradient (8, 4), `_foreach_mul_` of v (4, 4), `_foreach_addcmul_` of v with the gradient
squared (8, 4), `_foreach_sqrt` of v into a new list (4, 4), `_foreach_div_` and
`_foreach_add_` of it (4, 4 each), `_foreach_addcdiv_` of the parameters (12, 4): 80 bytes
where a fused step moves ADAM_BYTES' 28, 52 more; torchtitan's `clip_grad_norm_`
(torchtitan/utils.py at 9dec370) reads the gradients for `get_total_norm` (4) and
`clip_grads_with_norm_` scales them in place (`_foreach_mul_`, read 4, write 4): 12."""


def quantisation(m: int, n: int, k: int, hw: Hardware) -> float:
    """Fraction of the tiles' work that is useful (tile quantisation), the better of cuBLAS's
    two usual bf16 tiles in either orientation. `k` and `hw` do not enter: kept for the
    signature of a GEMM."""
    best = 0.0
    for tm, tn in TILES:
        for a, b in ((m, n), (n, m)):
            best = max(best, a * b / (math.ceil(a / tm) * tm * math.ceil(b / tn) * tn))
    return best


def gemm_time(m: int, n: int, k: int, hw: Hardware, precision: str = "bf16",
              count: int = 1, sustained: bool = True) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM (module doc), or of `count` of them in one
    batched call (one GEMM_OVERHEAD); at the rate a power-saturated GPU holds
    (`Hardware.sustained`), or `sustained=False` at the burst rate a microbenchmark
    measures."""
    clock = hw.sustained if sustained else 1.0
    if precision == "fp8":
        rate, size = hw.fp8_flops * hw.fp8_matmul_efficiency * clock, 1
    else:
        rate, size = hw.flops * hw.matmul_efficiency * clock, 2
    compute = 2 * m * n * k / (rate * quantisation(m, n, k, hw) * k / (k + GEMM_K0))
    traffic = (size * (m * k + k * n) + 2 * m * n) / hw.achievable_bandwidth
    return GEMM_OVERHEAD + count * max(compute, traffic)


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware, dtype_bytes: int = 2) -> float:
    """Fraction (0, 1] of a large GEMM's kernel rate (`Hardware.matmul_efficiency` x
    `sustained` of peak) that an (m x k) @ (k x n) GEMM reaches in `gemm_time`'s model: its
    FLOPs at that rate over its `gemm_time` (tile quantisation, the pipeline's fill over a
    short k, the memory roofline and the call's fixed cost). `step_time` prices each GEMM
    at `mfu` x this, so that at the preset's rate a GEMM costs what `gemm_time` says: one
    GEMM model for both (`dtype_bytes` 1: fp8's rate; otherwise bf16's)."""
    for name, value in (("m", m), ("n", n), ("k", k), ("dtype_bytes", dtype_bytes)):
        check_int(name, value)
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    precision = "fp8" if dtype_bytes == 1 else "bf16"
    rate = (hw.fp8_flops * hw.fp8_matmul_efficiency if precision == "fp8"
            else hw.flops * hw.matmul_efficiency) * hw.sustained
    if precision == "fp8" and not hw.fp8_flops:
        raise ValueError(f"dtype_bytes = 1 (fp8) needs fp8 Tensor Cores; {hw.name} has none")
    return 2 * m * n * k / rate / gemm_time(m, n, k, hw, precision)


def layer_linear_flops(shape: BlockShape) -> float:
    """Forward FLOPs per token of one layer's linears: 2 x their weights."""
    h, f = shape.hidden, shape.ffn_size
    return 2 * (h * (h + 2 * shape.kv_dim) + h * h + (3 if shape.gated else 2) * h * f)


def linear_gemms(shape: BlockShape, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """One layer's forward GEMMs on one TP rank, (m, n, k): QKV, output, MLP in and out.
    Past tp = n_kv_heads each rank still computes k and v for a whole KV head (the heads
    are replicated, not split further): 2 x max(h_kv / t, head width) columns."""
    h, f = shape.hidden, shape.ffn_size
    width = (2 if shape.gated else 1) * f
    kv = max(shape.kv_dim // tp, h // shape.heads)
    return [(tokens, max(1, h // tp) + 2 * kv, h), (tokens, h, max(1, h // tp)),
            (tokens, max(1, width // tp), h), (tokens, h, max(1, f // tp))]


def op_sac_recomputed_gemms(shape: BlockShape, tokens: int,
                            tp: int) -> list[tuple[int, int, int]]:
    """The forward GEMMs torchtitan's op-level SAC recomputes in backward, (m, n, k) on one
    rank: every second mm of the layer (`tplab.cost.memory.op_sac_layer` keeps the others):
    wk, wo and w3 (a gated MLP) or fc2 (a plain one)."""
    h, f = shape.hidden, shape.ffn_size
    kv = max(shape.kv_dim // tp, h // shape.heads)
    last = (tokens, max(1, f // tp), h) if shape.gated else (tokens, h, max(1, f // tp))
    return [(tokens, kv, h), (tokens, h, max(1, h // tp)), last]


def linear_time(shape: BlockShape, tokens: int, tp: int, hw: Hardware,
                precision: str = "bf16") -> float:
    """Seconds of one layer's forward GEMMs on one rank (each backward GEMM, input and
    weight gradient, costs the same shape transposed: the same time)."""
    return sum(gemm_time(m, n, k, hw, precision) for m, n, k in linear_gemms(shape, tokens, tp))


def fp8_cast_bytes(shape: BlockShape, tokens: int, tp: int, hw: Hardware,
                   recipe: str = "unfused") -> tuple[float, float]:
    """(forward, backward) bytes one rank's fp8 quantisation moves in one layer. "unfused"
    (torchao's float8 tensorwise recipe as torchtitan runs it): each linear's input and
    weight (forward) and output gradient (backward) quantised once, FP8_CAST_BYTES per
    element (module doc), one more where the fp8 GEMMs need the transposed copy too
    (Hopper: `Hardware.fp8_any_layout` False). "te-delayed", "te-current": `te_cast_bytes`."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"recipe = {recipe!r}: expected one of {FP8_RECIPES}")
    if recipe != "unfused":
        return te_cast_bytes(shape, tokens, tp, hw, recipe)
    per = FP8_CAST_BYTES + (0 if hw.fp8_any_layout else 1)
    gemms = linear_gemms(shape, tokens, tp)
    forward = sum(m * k + k * n for m, n, k in gemms)
    return per * forward, per * sum(m * n for m, n, _ in gemms)


FP8_TP_ROLES = {"unfused": (), "te-delayed": ("fwd_in", "fwd_out", "bwd_out", "regather"),
                "te-current": ("fwd_in", "bwd_out", "regather")}
"""The TP collectives (`transformer.block_collectives` roles) that move fp8, 1 byte an
element, under each recipe. Transformer Engine quantises before it gathers: LayerNormLinear's
norm writes its output in fp8 into the all-gather's buffer, and backward re-gathers that
saved fp8 shard (TransformerEngine 3b2a7b00, v1.14, module/layernorm_linear.py: `ln_out =
ub_obj_lnout.get_ubuf_output(0)`, `ub_obj_lnout.copy_input_to_ubuf(ln_out, 1)`; v2.9
`gather_along_first_dim(ln_out, tp_group, quantizer=quantizer)`); the row-parallel
linears' output gradient is cast to fp8 and then gathered (module/base.py
`grad_output_preprocess`, "FP8 case with gather"). The forward reduce-scatter moves fp8
only where the GEMM can write fp8 before it knows the output's amax, delayed scaling with
`fp8_buf=True` on proj_fprop and fc2_fprop (NeMo d2b21556 recipes/tp_overlap_configs/
userbuffers.py, `userbuffers_fp8_h100_*`, which dgxc-benchmarking v25.04.01 sets; its
v25.01 configure.sh `proj_fprop.fp8_buf=$FP8_ENABLED`; TE 1.14 comm_gemm_overlap.cpp
`reducescatter2_userbuff_stridedoutput_fp8`); Megatron-Bridge's current-scaling H100
config has no fp8 buffer there (v0.2.0 training/comm_overlap.py
`userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192`: RingExchangeOverlapCfg, fp8_buf False).
The input-gradient reduce-scatter stays bf16 in both."""


def te_cast_bytes(shape: BlockShape, tokens: int, tp: int, hw: Hardware,
                  recipe: str = "te-delayed") -> tuple[float, float]:
    """(forward, backward) bytes Transformer Engine's quantisation moves in one layer on one
    rank, Megatron's TE layer (LayerNormLinear for QKV and FC1, Linear for the output
    projection and FC2: core/models/gpt/gpt_layer_specs.py at ee6737da; sequence parallel
    when tp > 1), read in TransformerEngine 3b2a7b00
    (v1.14, NeMo d2b21556's manifest; delayed scaling) and v2.9 (Megatron-Bridge v0.2.0's
    pin; current scaling), Hopper's transposed copies where `hw.fp8_any_layout` is False:

    - weights: none per micro-batch. Megatron's TE wrappers pass `is_first_microbatch`
      (Megatron-LM ee6737da, core/pipeline_parallel/schedules.py `set_is_first_microbatch`),
      so TE casts a bf16 weight once a step (module/linear.py `get_fp8_workspace(...,
      update_workspace=is_first_microbatch)`), and with fp8 parameters (the recipes'
      `fp8_params`, `fp8_param_gather`) the weight is fp8 already and its transpose cached
      (tensor/float8_tensor.py `transpose_2d(fill_cache=True)`).
    - a cast reads bf16 (2) and writes fp8 (1); current scaling first reads the tensor for
      its amax (2 more), delayed scaling takes the scale from the amax history and records
      the amax inside the cast kernel (no extra pass).
    - the norm-fed inputs (QKV, FC1): delayed, the norm kernel writes fp8 itself (no cast);
      current, the norm computes the amax as it writes bf16 (v2.9
      csrc/extensions/normalization.cpp FUSED_NORM_AMAX_FP8), then one cast.
    - the transposed copy: written by the same kernel as the cast (+1) where nothing is
      gathered in between (`fp8_cast_transpose_fused`; v2.9 a quantizer with rowwise and
      columnwise usage), else a separate fp8 transpose of the gathered tensor (read 1,
      write 1): the norm-fed inputs (v1.14 `tex.fp8_transpose(ln_out_total)` always; v2.9
      when gathered, "All-gather is not supported with FP8 column-wise data"), the
      row-parallel output gradients under sequence parallelism, and, in v1.14, the
      row-parallel inputs under it (`cast_to_fp8` when `sequence_parallel`, transposed in
      backward)."""
    h = shape.hidden
    sp, t_cols = tp > 1, 0 if hw.fp8_any_layout else 1
    amax, delayed = (0, True) if recipe == "te-delayed" else (2, False)
    (_, qkv, _), (_, _, attn), (_, fc1, _), (_, _, fc2) = linear_gemms(shape, tokens, tp)
    local = tokens * h / (tp if sp else 1)        # a sequence shard of an h-wide tensor
    # QKV's and FC1's inputs, the norm's output: delayed, written in fp8 by the norm and
    # transposed in backward; current, cast on the shard, transposed once gathered (in the
    # cast's pass when nothing is gathered)
    if delayed:
        forward, backward = 0.0, 2 * 2 * t_cols * tokens * h
    elif sp:
        forward, backward = 2 * 3 * local, 2 * 2 * t_cols * tokens * h
    else:
        forward, backward = 2 * (3 + t_cols) * tokens * h, 0.0
    # the output projection's and FC2's inputs (bf16 from attention and the activation)
    row_in = tokens * (attn + fc2)
    split = delayed and sp                         # v1.14: cast now, transpose in backward
    forward += (amax + 3 + (0 if split else t_cols)) * row_in
    backward += 2 * t_cols * row_in if split else 0.0
    # output gradients: QKV's and FC1's on this rank; the projection's and FC2's gathered
    col_out = tokens * (qkv + fc1)
    backward += (amax + 3 + t_cols) * col_out
    backward += 2 * ((amax + 3) * local + 2 * t_cols * tokens * h if sp
                     else (amax + 3 + t_cols) * tokens * h)
    return forward, backward


def elementwise_bytes(shape: BlockShape, tokens: int, tp: int, kernels: str = "fused") -> float:
    """Bytes one rank's element-wise ops move in one layer's forward (module doc)."""
    h, f = shape.hidden, shape.ffn_size
    split = tp if tp > 1 else 1    # sequence parallel whenever TP > 1 (Megatron-LM)
    if kernels == "eager" and shape.gated:
        per_token = (2 * 36 * h + 12 * h) / split + (20 * (h + shape.kv_dim) + 4 * h) / tp
        return tokens * (per_token + 10 * f / tp)
    per_token = (8 * h + 12 * h) / split + 4 * (h + shape.kv_dim) / tp
    per_token += (6 if shape.gated else 4) * f / tp
    return tokens * per_token


def attention_time(shape: BlockShape, cp: int, tp: int, hw: Hardware,
                   attention: str = "flash", efficiency: float | None = None) -> float:
    """Forward seconds of one layer's attention core on one rank (module doc); flash
    attention at `efficiency` x peak when given (`tplab.cost.attention_rates`, by kernel
    and shape), else at `hw.attention_efficiency`."""
    local = shape.seq // cp
    heads = max(1, shape.heads // tp)
    if attention == "flash":
        flops = 2 * shape.batch * shape.seq * local * shape.hidden / tp
        rate = hw.attention_efficiency if efficiency is None else efficiency
        return flops / (hw.flops * rate * hw.sustained)
    d, count = shape.hidden // shape.heads, shape.batch * heads
    gemms = gemm_time(local, shape.seq, d, hw, count=count) + gemm_time(
        local, d, shape.seq, hw, count=count)   # Q K^T (k = head width), then P V
    scores = shape.batch * heads * shape.seq * local
    return gemms + SCORE_BYTES * scores / hw.achievable_bandwidth


def attention_backward(shape: BlockShape, cp: int, tp: int, hw: Hardware,
                       attention: str = "flash", efficiency: float | None = None) -> float:
    """Backward seconds of the attention core: flash attention's backward recomputes the
    scores, 5 matmuls to the forward's 2, FLASH_BACKWARD x its FLOPs at the forward's rate
    or at the backward's own `efficiency` when given (`tplab.cost.attention_rates`);
    unfused, the four gradient GEMMs (dP = dO V^T and dQ = dS K over the local queries,
    dV = P^T dO and dK = dS^T Q over the keys) and twice the forward's score bytes."""
    fwd = attention_time(shape, cp, tp, hw, attention, efficiency)
    if attention == "flash":
        return FLASH_BACKWARD * fwd
    local, seq = shape.seq // cp, shape.seq
    heads = max(1, shape.heads // tp)
    d, count = shape.hidden // shape.heads, shape.batch * heads
    gemms = (gemm_time(local, seq, d, hw, count=count) + gemm_time(local, d, seq, hw, count=count)
             + 2 * gemm_time(seq, d, local, hw, count=count))
    return gemms + 2 * SCORE_BYTES * shape.batch * heads * seq * local / hw.achievable_bandwidth


def head_time(shape: BlockShape, tokens: int, tp: int, hw: Hardware,
              precision: str = "bf16") -> float:
    """Forward + backward seconds of the LM head (vocabulary split t ways) and the loss on
    its fp32 logits. The head stays in bf16 under fp8 (Transformer Engine's recipe)."""
    if not shape.vocab:
        return 0.0
    vocab = -(-shape.vocab // tp)
    gemm = gemm_time(tokens, vocab, shape.hidden, hw, "bf16")
    return 3 * gemm + tokens * vocab * LOSS_BYTES / hw.achievable_bandwidth


def local_params(shape: BlockShape, tp: int, pp: int) -> float:
    """Parameter elements one GPU holds before any sharding: 1/(t p) of the model."""
    return param_count(shape, tp) / pp


def optimizer_time(shape: BlockShape, tp: int, pp: int, replicas: int, sharding: str,
                   hw: Hardware, kernels: str = "fused") -> float:
    """Seconds of the optimizer step on one GPU: its share of the parameters (all of them
    under DDP, 1/replicas otherwise) times ADAM_BYTES + OPTIMIZER_EXTRA[kernels] over the
    memory bandwidth."""
    n = local_params(shape, tp, pp) / (1 if sharding == "ddp" else replicas)
    return n * (ADAM_BYTES + OPTIMIZER_EXTRA[kernels]) / hw.achievable_bandwidth
