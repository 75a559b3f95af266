"""The kernels of a training step on one GPU, timed: GEMMs at a measured kernel rate with one
roofline, element-wise work at the memory bandwidth, the LM head and loss, the optimizer.

GEMM: time = GEMM_OVERHEAD + max(2 m n k / (peak x `matmul_efficiency` x tile
quantisation x k / (k + GEMM_K0)), bytes / memory bandwidth). `matmul_efficiency` is the
best rate mamf-finder measured for large GEMMs (`tplab.cost.hardware`), so it is a kernel
rate, not an end-to-end MFU; the tile quantisation is NVIDIA's (Matrix Multiplication
Background guide: a dimension that is not a multiple of the 128 x 256 or 128 x 128 tile
pays for the whole last tile); k / (k + GEMM_K0) is the pipeline's fill over a short k and
GEMM_OVERHEAD the fixed cost of a call. Those two are fitted to XLA's published H100 GEMM
measurements (openxla/xla, tensorflow/tensorflow third_party/xla/xla/service/gpu/model/
matmul_interpolator_data.h, key "sm_90", bf16, b = 1: `GEMM_POINTS`), where the model's
median error is 5% (4% with m, n >= 1024, worst 7%); wave quantisation made it worse
(cuBLAS picks tiles and split-K to fill the SMs) and is left out. The memory roofline is
applied once, to the bytes the GEMM reads and writes (unlike `gemm_efficiency`, which
derates a rate that `step_time` then derates again).

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

The backward pass moves twice the forward's bytes. The loss reads and writes the fp32
logits: 12 bytes per logit.

Attention, by `attention=`: "flash" (FlashAttention: causal tiles skipped, half of
4 b s^2 h, at `Hardware.attention_efficiency`) or "unfused" (Megatron-LM in 2022,
Korthikanti et al. section 4.1: Q K^T and the product with V as batched GEMMs over the
full s x s scores at the matmul rate, and the scores written, soft-maxed, masked and
dropped out in memory: 11 bytes per score forward (bf16 scores 2, softmax read and write
4, a 1-byte dropout mask, its output 2, read again by the product 2), twice that backward).
"""

from __future__ import annotations

import math

from tplab.cost.hardware import Hardware
from tplab.cost.memory import param_count
from tplab.cost.shapes import BlockShape

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
ADAM_BYTES = 30
"""Bytes Adam moves per local parameter per step: reads fp32 master, m, v and gradient (16),
writes master, m and v (12) and the bf16 copy (2)."""


def quantisation(m: int, n: int, k: int, hw: Hardware) -> float:
    """Fraction of the tiles' work that is useful (tile quantisation), the better of cuBLAS's
    two usual bf16 tiles in either orientation. `k` and `hw` do not enter: kept for the
    signature of a GEMM."""
    best = 0.0
    for tm, tn in TILES:
        for a, b in ((m, n), (n, m)):
            best = max(best, a * b / (math.ceil(a / tm) * tm * math.ceil(b / tn) * tn))
    return best


def gemm_time(m: int, n: int, k: int, hw: Hardware, precision: str = "bf16") -> float:
    """Seconds of one (m x k) @ (k x n) GEMM (module doc)."""
    if precision == "fp8":
        rate, size = hw.fp8_flops * hw.fp8_matmul_efficiency, 1
    else:
        rate, size = hw.flops * hw.matmul_efficiency, 2
    compute = 2 * m * n * k / (rate * quantisation(m, n, k, hw) * k / (k + GEMM_K0))
    traffic = (size * (m * k + k * n) + 2 * m * n) / hw.memory_bandwidth
    return GEMM_OVERHEAD + max(compute, traffic)


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


def linear_time(shape: BlockShape, tokens: int, tp: int, hw: Hardware,
                precision: str = "bf16") -> float:
    """Seconds of one layer's forward GEMMs on one rank (each backward GEMM, input and
    weight gradient, costs the same shape transposed: the same time)."""
    return sum(gemm_time(m, n, k, hw, precision) for m, n, k in linear_gemms(shape, tokens, tp))


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
                   attention: str = "flash") -> float:
    """Forward seconds of one layer's attention core on one rank (module doc)."""
    local = shape.seq // cp
    heads = max(1, shape.heads // tp)
    if attention == "flash":
        flops = 2 * shape.batch * shape.seq * local * shape.hidden / tp
        return flops / (hw.flops * hw.attention_efficiency)
    flops = 4 * shape.batch * shape.seq * local * shape.hidden / tp
    scores = shape.batch * heads * shape.seq * local
    return flops / (hw.flops * hw.matmul_efficiency) + 11 * scores / hw.memory_bandwidth


def head_time(shape: BlockShape, tokens: int, tp: int, hw: Hardware,
              precision: str = "bf16") -> float:
    """Forward + backward seconds of the LM head (vocabulary split t ways) and the loss on
    its fp32 logits. The head stays in bf16 under fp8 (Transformer Engine's recipe)."""
    if not shape.vocab:
        return 0.0
    vocab = -(-shape.vocab // tp)
    gemm = gemm_time(tokens, vocab, shape.hidden, hw, "bf16")
    return 3 * gemm + tokens * vocab * LOSS_BYTES / hw.memory_bandwidth


def local_params(shape: BlockShape, tp: int, pp: int) -> float:
    """Parameter elements one GPU holds before any sharding: 1/(t p) of the model."""
    return param_count(shape, tp) / pp


def optimizer_time(shape: BlockShape, tp: int, pp: int, replicas: int, sharding: str,
                   hw: Hardware) -> float:
    """Seconds of the Adam step on one GPU: its share of the parameters (all of them under
    DDP, 1/replicas otherwise) times ADAM_BYTES over the memory bandwidth."""
    n = local_params(shape, tp, pp) / (1 if sharding == "ddp" else replicas)
    return n * ADAM_BYTES / hw.memory_bandwidth
