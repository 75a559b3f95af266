"""Per-GPU memory of a transformer under TP: parameters, gradients, optimizer state and the
activations saved for backward, by TP degree t, sequence parallelism and recomputation.

**Parameters, gradients, optimizer state** (bytes per parameter element):

| precision | parameters | gradients | Adam state | SGD state | with Adam |
|---|---|---|---|---|---|
| "fp32" | 4 | 4 | 8 (m, v) | 0 | 16 |
| "bf16" | 2 | 2 | 4 (m, v in bf16) | 0 | 8 |
| "mixed" | 2 | 4 (fp32) | 12 (fp32 master, m, v) | 4 (master) | 18 |
| "mixed_bf16_grads" | 2 | 2 | 12 | 4 | 16 |

"mixed" is Megatron-LM's bf16 recipe: `--bf16` accumulates and reduces gradients in fp32
(`accumulate_allreduce_grads_in_fp32`), so its distributed-optimizer docs count 18 bytes
per parameter, 6 + 12/d with the optimizer state sharded over d data-parallel replicas
(docs/source/api-guide/dist_optimizer.md). "mixed_bf16_grads" is the ZeRO paper's 2 + 2 + 12
(Rajbhandari et al. 2020, section 3.1), 2-byte gradients.

TP splits every matrix of a block and the vocabulary of the embedding and the lm head
(Megatron's VocabParallelEmbedding) by t; the norms' weights are replicated on every rank.

**Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4, Table 2). For s tokens per sequence, b sequences, hidden
size h and a heads, with 2-byte activations, the paper's GPT layer saves per layer

| | bytes per layer |
|---|---|
| no parallelism | sbh (34 + 5as/h) |
| TP, degree t | sbh (10 + 24/t + 5as/(ht)) |
| TP + SP | sbh/t (34 + 5as/h) |
| selective recomputation | the 5as/h term goes (the attention scores are recomputed) |
| full recomputation | 2sbh, the layer's input (a sequence shard under SP: 2sbh/t) |

`gpt_layer` lists the tensors behind those constants (section 4.1), so that each one can be
seen: 10 sbh stay whole under TP (two LayerNorm inputs, the inputs of the QKV and first MLP
linears, two dropout masks) and SP splits them over the sequence.

**tplab's own block** (`tplab.models.Block`, `tplab_layer`, measured byte for byte by
`tplab.memory` in tests/test_memory.py) saves, per token, with d-byte activations (torch's
RMSNorm computes in fp32, so its tensors are 4-byte whatever d is):

| module | saved | elements per token (bytes each) | split by |
|---|---|---|---|
| attention_norm, ffn_norm | input, rstd, normalised input | h, 1, h (4: fp32) | SP |
| (with norm="fused") | input, rstd | h (d), 1 (4) | SP |
| attention.wq | the normed input (wk, wv share it) | h (d) | - |
| attention | q, k, v, the output, logsumexp | h + 2 h_kv + h (d), a (4) | TP |
| feed_forward.w1 | the normed input (w3 shares it) | h (d) | - |
| feed_forward | w1 x, silu(w1 x), w3 x | 3f (d) | TP |
| feed_forward.w2 | silu(w1 x) * w3 x | f (d) | TP |
| (with swiglu="fused") feed_forward | [w1 x, w3 x], the fused FC1 output | 2f (d) | TP |
| (with swiglu="fused") feed_forward.w2 | its input | f (d) | TP |

Where it differs from the paper's GPT layer, in bytes per token at d = 2, f = 4h and no
GQA (the paper's 34h + 5as against tplab's 60h + 4a + 8):
- RMSNorm saves its input and its normalised input in fp32 and rstd, 8h + 4 bytes, where
  the paper's LayerNorm saves its 2-byte input, 2h: +12h + 8 for the two norms.
- No dropout: -2h (the two 1-byte masks outside the TP regions).
- Attention is fused (scaled_dot_product_attention's flash kernel): it keeps a 4-byte
  logsumexp per head, 4a, instead of the scores, softmax and mask, 5as; so selective
  recomputation has nothing left to remove.
- SwiGLU saves four f-sized tensors, 8f = 32h, where the paper's GeLU MLP saves 16h: +16h.
- Under SP the linears' inputs are the all-gathered sequence, saved whole, 4h per token
  on every rank; Megatron-LM saves the shard and all-gathers it again in backward (section
  4.2.2), 4h/t: tplab keeps 4h (t-1)/t bytes per token more.
The differences are asserted in tests/test_memory.py.

**Which RMSNorm path** (`norm=`): "composite" (the default) is what torch's RMSNorm saves on
CPU, where it runs as composite ops in fp32 (8h + 4 bytes per token, measured by
`tplab.memory`); "fused" is what CUDA's fused kernel, Transformer Engine and Megatron-LM
save: the d-byte input and the fp32 rstd, 2h + 4 bytes at d = 2. For Llama-3 70B at TP 4
with SP and 4096 tokens the difference is 12h x 4096 / 4 x 80 layers, about 8 GB per GPU.
Rows say which path they used (`norm`).

**Which SwiGLU** (`swiglu=`): "composite" (the default) is tplab's `silu(w1 x) * w3 x` in
eager torch, which saves four f-sized tensors, 8f bytes per token at d = 2 (measured);
"fused" is Megatron-LM's `bias_swiglu_impl` (megatron/core/fusions/fused_bias_swiglu.py):
its SwiGLUFunction saves only its input, the fused FC1 output [w1 x, w3 x] (4f bytes), and
FC2 saves its input (2f): 6f bytes per token.

**tplab's block or Megatron-LM's** (`BLOCK_SAVES`): the three choices that differ between
them, as keyword arguments for `activation_bytes`, `gpu_memory`, `step_time` and `sweep`.
`BLOCK_SAVES["tplab"]` is what tplab's own block saves on the lab's CPU ranks (measured
byte for byte: composite norm, composite SwiGLU, gathered SP inputs);
`BLOCK_SAVES["megatron"]` is what Megatron-LM saves on GPUs (fused RMSNorm, fused SwiGLU,
the 1/t shard of each SP-gathered linear input, gathered again in backward). For Llama-3
70B at TP 4 + SP with 4096 tokens, Megatron's choices save about 20.8 GB per GPU (8.1 of
it the norms, 8.1 the linear inputs' shards, 4.7 SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tplab.cost.shapes import BlockShape
from tplab.cost.transformer import SP_SAVES
from tplab.cost.validate import check_bool, check_choice, check_int, check_sublayers, check_type

PRECISIONS = ("fp32", "bf16", "mixed", "mixed_bf16_grads")
RECOMPUTE = ("none", "selective", "full")
LAYOUTS = ("tplab", "gpt")
NORMS = ("composite", "fused")
SWIGLUS = ("composite", "fused")
BLOCK_SAVES = {"tplab": {"norm": "composite", "swiglu": "composite", "sp_saves": "gathered"},
               "megatron": {"norm": "fused", "swiglu": "fused", "sp_saves": "shard"}}
# bytes per parameter element: parameters, gradients, optimizer state (module doc)
PARAM_BYTES = {"fp32": 4, "bf16": 2, "mixed": 2, "mixed_bf16_grads": 2}
GRAD_BYTES = {"fp32": 4, "bf16": 2, "mixed": 4, "mixed_bf16_grads": 2}
OPTIMIZER_BYTES = {"adam": {"fp32": 8, "bf16": 4, "mixed": 12, "mixed_bf16_grads": 12},
                   "sgd": {"fp32": 0, "bf16": 0, "mixed": 4, "mixed_bf16_grads": 4}}


@dataclass(frozen=True)
class Saved:
    """One tensor a layer saves for backward: `per_token` elements of `element_bytes` each,
    split over the TP ranks (`tp`), over the sequence under SP (`sp`), and dropped by
    selective recomputation (`selective`)."""

    module: str
    what: str
    per_token: int
    element_bytes: int
    tp: bool = False
    sp: bool = False
    selective: bool = False
    linear_input: bool = False   # a TP region's input: whole or a shard under SP (sp_saves)

    def local_bytes(self, tokens: int, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes one rank holds: an int whenever the split is even."""
        total = self.per_token * self.element_bytes * tokens
        parts = tp if (self.tp or (self.sp and sequence_parallel)) else 1
        return total // parts if total % parts == 0 else total / parts


def tplab_layer(shape: BlockShape, sublayers=("attention", "mlp"), prefix: str = "",
                norm: str = "composite", swiglu: str = "composite") -> list[Saved]:
    """What `tplab.models.Block` (or, with sublayers=("mlp",), `tplab.models.MLP` when the
    shape is not gated) saves for backward, one `Saved` per tensor; see the module doc.
    `norm`: which RMSNorm path ("composite": CPU, measured; "fused": CUDA, TE, Megatron).
    `swiglu`: "composite" (tplab's eager SwiGLU, 8f bytes per token at d = 2, measured) or
    "fused" (Megatron-LM's fused_bias_swiglu.py, 6f); a plain MLP ignores it."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_choice("norm", norm, NORMS)
    check_choice("swiglu", swiglu, SWIGLUS)
    h, d, a = shape.hidden, shape.dtype_bytes, shape.heads
    kv = shape.kv_dim
    f = shape.ffn_size
    out: list[Saved] = []

    def norm_saves(module):
        if norm == "fused":
            return [Saved(module, "input", h, d, sp=True),
                    Saved(module, "rstd (fp32)", 1, 4, sp=True)]
        return [Saved(module, "input (fp32)", h, 4, sp=True),
                Saved(module, "rstd (fp32)", 1, 4, sp=True),
                Saved(module, "normalised input (fp32)", h, 4, sp=True)]

    if "attention" in sublayers:
        out += norm_saves("attention_norm")
        out += [Saved("attention.wq", "normed input (q, k, v)", h, d, linear_input=True),
                Saved("attention", "q", h, d, tp=True),
                Saved("attention", "k", kv, d, tp=True),
                Saved("attention", "v", kv, d, tp=True),
                Saved("attention", "attention output (wo input)", h, d, tp=True),
                Saved("attention", "logsumexp (fp32)", a, 4, tp=True)]
    if "mlp" in sublayers:
        ff = prefix if "attention" not in sublayers else "feed_forward"
        path = (lambda name: f"{ff}.{name}" if ff else name)
        if "attention" in sublayers:
            out += norm_saves("ffn_norm")
        out.append(Saved(path("w1"), "input (w1, w3)" if shape.gated else "input", h, d,
                         linear_input=True))
        if shape.gated and swiglu == "fused":
            out += [Saved(ff, "[w1 x, w3 x] (fused swiglu input)", 2 * f, d, tp=True),
                    Saved(path("w2"), "swiglu output", f, d, tp=True)]
        elif shape.gated:
            out += [Saved(ff, "w1 x (silu input)", f, d, tp=True),
                    Saved(ff, "silu(w1 x)", f, d, tp=True),
                    Saved(ff, "w3 x", f, d, tp=True),
                    Saved(path("w2"), "silu(w1 x) * w3 x", f, d, tp=True)]
        else:
            out += [Saved(ff, "w1 x (gelu input)", f, d, tp=True),
                    Saved(path("w2"), "gelu(w1 x)", f, d, tp=True)]
    return out


def gpt_layer(shape: BlockShape) -> list[Saved]:
    """Korthikanti et al. 2022, section 4.1: the tensors of a GPT layer behind
    sbh (34 + 5as/h), with d-byte activations (2 in the paper) and 1-byte dropout masks."""
    h, d, a, s, f = shape.hidden, shape.dtype_bytes, shape.heads, shape.seq, shape.ffn_size
    return [
        Saved("attention_norm", "LayerNorm input", h, d, sp=True),
        Saved("attention", "QKV input", h, d, sp=True, linear_input=True),
        Saved("attention", "Q", h, d, tp=True),
        Saved("attention", "K", h, d, tp=True),
        Saved("attention", "softmax output", a * s, d, tp=True, selective=True),
        Saved("attention", "softmax dropout mask", a * s, 1, tp=True, selective=True),
        Saved("attention", "softmax dropout output", a * s, d, tp=True, selective=True),
        Saved("attention", "V", h, d, tp=True),
        Saved("attention", "output projection input", h, d, tp=True),
        Saved("attention", "dropout mask", h, 1, sp=True),
        Saved("ffn_norm", "LayerNorm input", h, d, sp=True),
        Saved("feed_forward", "first linear input", h, d, sp=True, linear_input=True),
        Saved("feed_forward", "GeLU input", f, d, tp=True),
        Saved("feed_forward", "GeLU output (second linear input)", f, d, tp=True),
        Saved("feed_forward", "dropout mask", h, 1, sp=True),
    ]


def mpt_layer(shape: BlockShape) -> list[Saved]:
    """What MPT's block saves for backward as llm-foundry v0.3.0 benchmarked it (every
    dropout at p = 0, so no masks: configuration_mpt.py; ATen's dropout returns its input at
    p = 0), read from its code: `MPTBlock.forward` (blocks.py) runs norm_1, attention,
    norm_2, the MLP; `LPLayerNorm` (norm.py, low_precision_layernorm) runs F.layer_norm on
    the bf16 input (saved, with fp32 mean and rstd); Wqkv keeps its input; the split q, k,
    v are views of one qkv tensor that `FlashAttnFunc` (flash_attn_triton.py) saves with
    its output o (out_proj's input, the same tensor) and an fp32 logsumexp per head;
    `MPTMLP` (ffn.py) keeps up_proj's input, GELU's input and down_proj's input. Per token
    at d = 2: 32h + 4a + 16 bytes (the paper's GPT layer, without dropout masks and with
    flash attention's logsumexp for its scores)."""
    h, d, a, f = shape.hidden, shape.dtype_bytes, shape.heads, shape.ffn_size
    kv = shape.kv_dim

    def norm(module):
        return [Saved(module, "input", h, d, sp=True),
                Saved(module, "mean, rstd (fp32)", 2, 4, sp=True)]

    return [*norm("norm_1"),
            Saved("attn.Wqkv", "input", h, d, linear_input=True),
            Saved("attn", "qkv (q, k, v views)", h + 2 * kv, d, tp=True),
            Saved("attn", "o (out_proj input)", h, d, tp=True),
            Saved("attn", "logsumexp (fp32)", a, 4, tp=True),
            *norm("norm_2"),
            Saved("ffn.up_proj", "input", h, d, linear_input=True),
            Saved("ffn", "GELU input", f, d, tp=True),
            Saved("ffn.down_proj", "GELU output", f, d, tp=True)]


def layer_saved(shape: BlockShape, recompute: str = "none", layout: str = "tplab",
                sublayers=("attention", "mlp"), sp_saves: str | None = None,
                norm: str = "composite", swiglu: str = "composite") -> list[Saved]:
    """The tensors one layer keeps for backward under a recomputation policy.

    "selective" drops what the paper recomputes (the attention scores); "full" keeps only
    the layer's input (Korthikanti et al. 2022, Table 2). `layout`: "tplab" (tplab's Block)
    or "gpt" (the paper's GPT layer). `sp_saves`: how a TP region keeps its input under SP,
    "gathered" (whole: DTensor, tplab's default) or "shard" (1/t, gathered again in
    backward: Megatron-LM, the paper's default); None: the layout's own. `norm` and
    `swiglu`: the RMSNorm and SwiGLU paths of tplab's layout (module doc; `BLOCK_SAVES`)."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("layout", layout, LAYOUTS)
    check_sublayers("sublayers", sublayers)
    if sp_saves is not None:
        check_choice("sp_saves", sp_saves, SP_SAVES)
    check_choice("norm", norm, NORMS)
    check_choice("swiglu", swiglu, SWIGLUS)
    if recompute == "full":
        return [Saved("", "layer input", shape.hidden, shape.dtype_bytes, sp=True)]
    items = (tplab_layer(shape, sublayers, norm=norm, swiglu=swiglu) if layout == "tplab"
             else gpt_layer(shape))
    if sp_saves is not None:
        items = [replace(i, sp=sp_saves == "shard") if i.linear_input else i for i in items]
    return [i for i in items if not (recompute == "selective" and i.selective)]


def op_sac_layer(shape: BlockShape) -> list[Saved]:
    """What torchtitan's op-level selective activation checkpointing keeps of one layer
    (torchtitan/parallelisms/parallelize_llama.py at 9dec370, `_apply_ac_to_transformer_block`
    with selective_ac_option "op"): torch.utils.checkpoint's selective policy saves the
    outputs of the ops in `_save_list` (mm, the SDPA flash and efficient kernels,
    reduce_scatter_tensor, abs, max) "except every second mm", counting the layer's mm calls
    from one (wq, wk, wv, wo, then w1, w3, w2 or fc1, fc2): the first, third, ... mm's
    outputs, the attention output and its logsumexp, and the block's input (the checkpoint's
    own argument); everything else (norms, RoPE, SwiGLU, the other mm's) is recomputed."""
    h, kv, f, d, a = shape.hidden, shape.kv_dim, shape.ffn_size, shape.dtype_bytes, shape.heads
    mms = [("attention.wq", h), ("attention.wk", kv), ("attention.wv", kv), ("attention.wo", h)]
    mms += ([("feed_forward.w1", f), ("feed_forward.w3", f), ("feed_forward.w2", h)]
            if shape.gated else [("feed_forward.fc1", f), ("feed_forward.fc2", h)])
    last = len(mms) - 1
    out = [Saved("", "layer input", h, d, sp=True)]
    out += [Saved(name, "mm output", n, d, tp=i != last, sp=i == last)
            for i, (name, n) in enumerate(mms) if i % 2 == 0]
    return out + [Saved("attention", "output", h, d, tp=True),
                  Saved("attention", "logsumexp", a, 4, tp=True)]


def activation_bytes(shape: BlockShape, tp: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none", layout: str = "tplab",
                     sublayers=("attention", "mlp"), sp_saves: str | None = None,
                     norm: str = "composite", swiglu: str = "composite") -> float:
    """Activation bytes one GPU keeps for backward, for ONE layer and one micro-batch."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    check_bool("sequence_parallel", sequence_parallel)
    tokens = shape.tokens
    return sum(i.local_bytes(tokens, tp, sequence_parallel)
               for i in layer_saved(shape, recompute, layout, sublayers, sp_saves, norm, swiglu))


def param_count(shape: BlockShape, tp: int = 1) -> float:
    """Parameter elements on one GPU: every block (matrices split by t, norm weights whole),
    the embedding and lm head split by t over the vocabulary, and the final norm. Past
    t = n_kv_heads Megatron splits the fused QKV weight t ways all the same (and gathers its
    output: `tplab.cost.transformer`), so the count stays 1/t."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    h, f = shape.hidden, shape.ffn_size
    kv = shape.kv_dim
    matrices = h * (h + 2 * kv) + h * h + (3 if shape.gated else 2) * h * f
    layer = matrices / tp + 2 * h
    vocab = 2 * shape.vocab * h / tp + h if shape.vocab else 0
    return shape.layers * layer + vocab


def check_sharding(shape, tp, dp, zero, precision) -> None:
    """The arguments the memory and DP-traffic models share, checked once: a ValueError or
    TypeError that names the argument."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("tp", tp)
    check_int("dp", dp)
    check_int("zero", zero, minimum=0)
    if zero > 3:
        raise ValueError(f"zero is a ZeRO stage, 0 to 3; got {zero!r}")
    check_choice("precision", precision, PRECISIONS)

MASTER_BYTES = 4
MASTER_IS_SHARD = True
"""Under ZeRO stage 3 (FSDP) with mixed precision, the shard a rank keeps is the fp32
parameter the optimizer steps: the master copy is the parameter (4 bytes) and the
optimizer state is the rest (Adam's two moments, 8); the bf16 copy exists only for the
layer gathered. torch's FSDP1 `MixedPrecision.param_dtype` and FSDP2
`MixedPrecisionPolicy.param_dtype` name the dtype of the gathered copy, not of the shard.
False: ZeRO's count (Rajbhandari et al. 2020, section 3.1), a bf16 parameter and a
separate fp32 master (benchmarks/published_choices.py prices both)."""
ZERO_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}
"""The ZeRO stage of each `TrainingRun.sharding` (HSDP shards like FSDP, within its group)."""


def state_bytes(n: float, zero: int, shard: int, precision: str = "mixed",
                optimizer: str = "adam") -> dict:
    """Parameter, gradient and optimizer-state bytes of `n` parameter elements on one GPU
    at ZeRO stage `zero` over `shard` ranks: the one count `gpu_memory` and
    `TrainingRun` (`tplab.cost.pipeline.memory`) both use. Stage 1 shards the optimizer
    state, 2 also the gradients, 3 also the parameters, whose shard holds the fp32 master
    under mixed precision (`MASTER_IS_SHARD`)."""
    param, grad = PARAM_BYTES[precision], GRAD_BYTES[precision]
    opt = OPTIMIZER_BYTES[optimizer][precision]
    if zero >= 3 and MASTER_IS_SHARD and precision.startswith("mixed"):
        param, opt = MASTER_BYTES, opt - MASTER_BYTES
    div = [shard if zero >= stage else 1 for stage in (3, 2, 1)]
    return {"param_bytes": n * param / div[0], "grad_bytes": n * grad / div[1],
            "optimizer_bytes": n * opt / div[2]}


def gpu_memory(shape: BlockShape, tp: int = 1, sequence_parallel: bool = False,
               recompute: str = "none", precision: str = "mixed", optimizer: str = "adam",
               layout: str = "tplab", sp_saves: str | None = None, dp: int = 1,
               zero: int = 0, norm: str = "composite", swiglu: str = "composite") -> dict:
    """Bytes one GPU holds for training with TP degree `tp`: parameters, gradients,
    optimizer state, and every layer's activations for one micro-batch (the embedding's
    output and the logits are left out, as in the paper's Table 2). Keys as `tplab.memory`:
    param_bytes, grad_bytes, optimizer_bytes, activation_bytes, and memory_bytes (the sum).

    `zero` with `dp` data-parallel replicas shards the model states over them (Rajbhandari
    et al. 2020, section 5; `state_bytes`, TrainingRun's count too): stage 1 the optimizer
    state (Megatron-LM's distributed optimizer), 2 also the gradients, 3 also the
    parameters (FSDP, whose fp32 shard is the master: 16/d bytes with "mixed" Adam; the
    one layer gathered at a time is left out). With "mixed" precision and zero=1 this is
    Megatron-LM's 6 + 12/d bytes per parameter. `norm`, `swiglu`, `sp_saves`: what a layer saves
    (`layer_saved`; `BLOCK_SAVES` names tplab's block and Megatron-LM's).
    """
    check_sharding(shape, tp, dp, zero, precision)
    check_choice("optimizer", optimizer, tuple(OPTIMIZER_BYTES))
    row = state_bytes(param_count(shape, tp), zero, dp, precision, optimizer)
    row |= {"activation_bytes": shape.layers * activation_bytes(
               shape, tp, sequence_parallel, recompute, layout, sp_saves=sp_saves, norm=norm,
               swiglu=swiglu)}
    row["memory_bytes"] = sum(row.values())
    return row
