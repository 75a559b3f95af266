"""The software stack a training run runs on, as an input of the cost model.

A `Stack` is a cited bundle: how the layer's element-wise work runs (fused or eager), the
attention kernel and its rate, what overlaps what (the data-parallel gradient reduction,
the TP input-gradient collectives, the pipeline's transfers), how FSDP syncs, and whose
context parallelism runs. `TrainingRun(stack=...)` takes a `STACKS` name; `DEFAULT_STACK`
is what a run that names none is priced as. Every published row names the stack it ran
(`tplab.cost.published`, docs/VALIDATION.md).

What each setting mirrors:

- Megatron-LM (NVIDIA/Megatron-LM) as Narayanan et al. 2021 ran it (aed2f75, 2021-04-11):
  `train_step` (megatron/training.py) reduces the gradients after the pipeline, the TP
  backward all-reduce is synchronous (megatron/mpu/mappings.py), the attention scores are
  materialised; the async TP all-reduce behind the weight-gradient GEMM came on 2021-09-02
  (16c90445, before Korthikanti et al. 2022), ordered before its GEMM by a no-op kernel
  until 2022-10-14 (bdd97312: "Remove noop used to try to force scheduling", after which
  Megatron-LM requires CUDA_DEVICE_MAX_CONNECTIONS=1, since "ordering isn't imposed by the
  scheduler"), so the 2022 stack does not count it hidden; `--overlap-p2p-comm` on 2023-05-31
  (f9283c5a), `--overlap-grad-reduce` on 2023-08-16 (2d5220a4).
- Megatron-Bridge / NeMo containers: Transformer Engine's fused layers, every overlap on
  (the recipes' defaults); attention in cuDNN's fused kernel on Hopper, which TE prefers
  there over FlashAttention ("to give FusedAttention preference on Hopper+",
  `get_attention_backend` from TE v1.2; `attention_kernel`, docs/VALIDATION.md round
  fourteen), as Megatron-LM with TE does.
- torchtitan (pytorch/torchtitan): eager PyTorch (or `torch.compile`, which fuses the
  element-wise work), SDPA's FlashAttention-2 (torch 1963fc8 of its H100 tables orders
  cuDNN last, #138522), FSDP2 prefetching behind compute, torch's
  `context_parallel` (`training_run.cp_exposed`).
- llm-foundry of 2023 (mosaicml/llm-foundry, the README's tables): `attn_impl: triton`
  (scripts/train/benchmarking/submit_benchmarks.py), MPT's
  llmfoundry/models/layers/flash_attn_triton.py, whose header says it is HazyResearch's
  FlashAttention-1 Triton kernel, "only tested on A100" and "slightly slower than" FA1's
  CUDA kernel. FlashAttention-2's abstract (Dao 2023) puts FA1 at "25-40% of the
  theoretical maximum FLOPs/s" and FA2 at "50-73%": the FA1 class runs at 32.5 / 50 of the
  FA2 rate a preset holds (`attention_scale`, the two ranges' lower bounds' ratio 25/50 and
  upper 40/73 bracket it: 0.50-0.55; their midpoints' ratio 32.5/61.5 = 0.53; this takes
  FA1's midpoint over the preset's own FA2 figure, 0.5 on A100). Composer (v0.16.3,
  trainer.py `_train_microbatches`) uses `no_sync` for DDP only, so FSDP reduce-scatters
  on every micro-batch, and the PR that produced the H100 table (llm-foundry #543, branch
  file scripts/train/benchmarking/larger_mb.md, commit beb8dee6) measures 7B on 8 A100s at
  micro-batch 1, 2, 4, 6: GPU-seconds per token fall as a + c / micro-batch tokens, c the
  FSDP traffic of one micro-batch, none of it hidden (`fsdp_exposed`).
- llm-foundry of 2024 (the README's Large Scale table, #838): as 2023's but with
  FlashAttention-2 (`attn_impl: flash`, flash-attn 2.4.2) for the 1B, 3B, 7B and 70B rows.
- DeepSpeed of 2021 (Narayanan 2021's ZeRO-3 rows): the stack whose per-parameter
  collectives the model does not price (`published.ZERO3_2021`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tplab.cost import attention_rates

KERNELS = ("fused", "eager")
ATTENTIONS = ("flash", "unfused")
BLOCKS = ("megatron", "mpt")
FP8_RECIPES = ("unfused", "te-delayed", "te-current")
"""`Stack.fp8_recipe`'s values (`tplab.cost.kernels.fp8_cast_bytes` prices each)."""
GATHERS = ("layer", "parameter")
OPTIMIZERS = ("", "foreach")
"""`Stack.optimizer`'s values: "" (the step `kernels` names), "foreach" (torch.optim.AdamW's
foreach implementation, `kernels.OPTIMIZER_EXTRA["foreach"]`)."""
PIPELININGS = ("megatron", "torch")
ZERO3_PREFETCH_ELEMENTS = 50_000_000
"""DeepSpeed 0.3.13's ZeRO-3 `prefetch_bucket_size` default, 5e7 elements (stage3.py; the
`published.DEEPSPEED_ZERO3_2021` reading): the parameters gathered ahead of the one in use."""


@dataclass(frozen=True)
class Stack:
    """One software stack (module doc). `attention_scale` multiplies the preset's flash
    attention rate (`Hardware.attention_efficiency`, FlashAttention-2's); `fsdp_exposed`:
    FSDP's per-micro-batch gathers and reduce-scatters wait (not prefetched behind compute);
    `logits_bytes`: bytes per token and vocabulary entry at the loss's peak (8: the fp32
    logits and their gradient, Megatron-LM's fused vocab-parallel cross entropy; 12:
    torchtitan's `loss_fn`, train.py at 9dec370, `cross_entropy(pred.flatten(0, 1).float()
    ...)`, then `del pred` before `loss.backward()`: in forward the bf16 logits, their fp32
    copy and log_softmax's fp32 output live together (10), in backward log_softmax's saved
    fp32 output, nll_loss's dense fp32 gradient and log_softmax's fp32 input gradient (12),
    while every activation is still held);
    `block`: whose layer's saved tensors the memory counts ("megatron": Megatron-LM's fused
    block, or Korthikanti's GPT layer for ungated shapes; "mpt": llm-foundry's MPT block,
    `memory.mpt_layer`); `sp_saves`: how a TP region keeps its input under sequence
    parallelism ("shard": Megatron-LM saves its 1/t shard and all-gathers it again in
    backward; "gathered": torchtitan's `apply_tp` turns the Shard(1) norm output into a
    Replicate DTensor (`PrepareModuleInput`) before wq/wk/wv and w1/w3, and each linear
    keeps that whole input, as tplab's own block does, `memory.BLOCK_SAVES`); 4 bytes per
    logit is flash-attn 1.0.9's fused cross entropy
    (losses/cross_entropy.py, MPT's default `loss_fn: fused_crossentropy` in llm-foundry
    v0.3.0's modeling_mpt.py): it saves the bf16 logits and its backward writes a new bf16
    gradient (`inplace_backward=False`, xentropy_kernel.cu `at::empty_like(logits_)`).
    `gathers`: what a fully sharded run holds gathered at once ("layer": FSDP's wrapped
    layer and the prefetched next one, torch FSDP and Composer's `limit_all_gathers`;
    "parameter": DeepSpeed 2021's ZeRO-3, one parameter at a time plus its prefetch bucket,
    `ZERO3_PREFETCH_ELEMENTS`).
    `tp_logits_bytes`: the same under TP where the stack's loss differs there (0: as
    `logits_bytes`); 16 for torchtitan, whose loss runs under torch's `loss_parallel`
    whenever TP > 1 (parallel_dims.py at 9dec370, `loss_parallel_enabled`: "self.tp > 1 and
    self.enable_loss_parallel", on unless --training.disable_loss_parallel). Its backward
    (torch/distributed/tensor/parallel/loss.py, `_nll_loss_and_log_softmax_backward`, the
    nll_loss and log_softmax backward fused as `(grad_input + torch.exp(x)) * grad_output`,
    read in torch 2.13 and at 02eef6b8; the version torchtitan ran, 1963fc8, is not
    stored here) holds the saved fp32 log_softmax output, a dense fp32 `grad_input`
    (`zeros_like(x)`), `exp(x)` and the sum, then the product: 16 bytes a logit where
    ATen's fused `_log_softmax_backward_data` peaks at 12. Measured on this CPU build
    (tests/test_cost_memory_runs.py: the resident-set peak of each backward, plain 12,
    under `loss_parallel` 16).
    `grad_bytes`: bytes of the gradient buffer each rank keeps and reduces per parameter
    (4: Megatron's fp32 `main_grad`, `grad_reduce_in_fp32=True`; 2: reduced in bf16, NeMo
    2's and Megatron-Bridge's performance recipes).
    `attention_kernel`: the flash attention kernel the stack runs where its rate was
    measured by shape (`tplab.cost.attention_rates`: "fa2", torch's FlashAttention-2
    backend; "cudnn", cuDNN's fused attention).
    `pipelining`: whose pipeline stages hold the activations ("megatron": the first stage's
    in-flight micro-batches, `pipeline.in_flight`; "torch": torch.distributed.pipelining's
    `PipelineStage` with torchtitan's split points, every rank through its schedule and
    the largest taken, `tplab.cost.pp_ranks`).
    `fp8_gathers`: under fp8, FSDP all-gathers each linear's weight in fp8 and keeps that
    1-byte copy as the unsharded weight (torchtitan's `--float8.enable_fsdp_float8_all_gather`,
    set by train_configs/llama3_405b.toml and the launch line of docs/float8.md at 9dec370;
    torchao eab345c torchao/float8/fsdp_utils.py: `fsdp_pre_all_gather` returns the fp8
    `_data`, `fsdp_post_all_gather` wraps the gathered bytes in a `Float8Tensor`): 1 byte a
    gathered linear weight element, not bf16's 2, in FSDP's gathered layers and, under PP
    (FSDP not resharding, "zero1"), in the whole stage's unsharded weights.
    `te_fp8`: under fp8 every linear is Transformer Engine's and keeps its own input
    quantised, 1 byte (`pipeline.te_fp8_saves`); `fp8_params`: fp8 primary weights
    (`fp8_param_gather`), the blocks' matrices held in fp8 (`pipeline.fp8_param_saving`);
    `embedding_slot`: where the layers do not divide into the pipeline's p x v chunks,
    Megatron's `account_for_embedding_in_pipeline_split` and
    `account_for_loss_in_pipeline_split` split L + 2 of them, and the memory counts the most
    loaded rank as Megatron's schedule fills it (`pipeline.held_layers`).
    `fp8_recipe`: how the linears' operands are quantised under fp8 (`kernels.FP8_RECIPES`,
    `kernels.fp8_cast_bytes`): "unfused" (torchao's tensorwise recipe as torchtitan runs
    it: every operand, weights included, read for its amax and cast each forward),
    "te-delayed" (Transformer Engine's delayed scaling: Megatron-LM's only fp8 recipe at
    ee6737da, core/extensions/transformer_engine.py `TEDelayedScaling`; NeMo's
    `bf16_with_fp8_mixed`), "te-current" (TE's current scaling, Megatron-Bridge's
    `bf16_with_fp8_current_scaling_mixed`); a published row may name its own
    (`fp8_recipe` in its data: dgxc-benchmarking's NeMo recipes run delayed scaling on the
    megatron-bridge stack). Under the TE recipes the TP all-gathers move fp8
    (`kernels.FP8_TP_ROLES`), and where the stack holds fp8 primary weights (`fp8_params`)
    so does the distributed optimizer's parameter all-gather (NeMo 2's `fp8_params = True`,
    mixed_precision.py at d2b21556; Megatron-Bridge's `fp8_param_gather = True`,
    training/mixed_precision.py at v0.2.0; NeMo 1's distributed_fused_adam casts the shards
    into a "Raw UINT8 buffer" it gathers, nemo/core/optim/distributed_adam.py at d2b21556).
    `optimizer`: whose optimizer step the stack runs where it is not the one its `kernels`
    name ("": `kernels.OPTIMIZER_EXTRA[kernels]`; "foreach": torch.optim.AdamW's foreach
    implementation, which torchtitan builds whether or not it compiles: optimizer.py at
    9dec370, `build_optimizers`, `"fused": fused, "foreach": not fused` with
    `--optimizer.fused` off by default in config_manager.py, and torch.compile wraps only
    the TransformerBlocks, `apply_compile`).
    `gather_copy`: FSDP2 copies every all-gather's output into the unsharded parameters on
    the compute stream (torch's `foreach_all_gather_copy_out`,
    torch/distributed/_composable/fsdp/_fsdp_collectives.py at 01d66d21: the current
    stream waits on the all-gather's event, then `torch.split_with_sizes_copy`;
    `pipeline.data_parallel`).
    `cites` says where each setting is read."""

    name: str
    kernels: str = "fused"
    attention: str = "flash"
    attention_scale: float = 1.0
    grad_overlap: bool = True
    tp_overlap: bool = True
    p2p_overlap: bool = True
    torch_cp: bool = False
    fsdp_exposed: bool = False
    logits_bytes: int = 8
    tp_logits_bytes: int = 0
    block: str = "megatron"
    sp_saves: str = "shard"
    gathers: str = "layer"
    grad_bytes: int = 4
    attention_kernel: str = "fa2"
    pipelining: str = "megatron"
    fp8_gathers: bool = False
    te_fp8: bool = False
    fp8_params: bool = False
    embedding_slot: bool = False
    fp8_recipe: str = "unfused"
    optimizer: str = ""
    gather_copy: bool = False
    cites: str = ""

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ValueError(f"Stack.kernels = {self.kernels!r}: expected one of {KERNELS}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"Stack.attention = {self.attention!r}: expected one of "
                             f"{ATTENTIONS}")
        if self.block not in BLOCKS:
            raise ValueError(f"Stack.block = {self.block!r}: expected one of {BLOCKS}")
        if self.sp_saves not in ("shard", "gathered"):
            raise ValueError(f"Stack.sp_saves = {self.sp_saves!r}: expected 'shard' or "
                             "'gathered'")
        if self.gathers not in GATHERS:
            raise ValueError(f"Stack.gathers = {self.gathers!r}: expected one of {GATHERS}")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"Stack.grad_bytes = {self.grad_bytes!r}: expected 4 (fp32 main "
                             "gradients) or 2 (reduced in bf16)")
        if self.attention_kernel not in attention_rates.KERNELS:
            raise ValueError(f"Stack.attention_kernel = {self.attention_kernel!r}: expected "
                             f"one of {attention_rates.KERNELS}")
        if self.pipelining not in PIPELININGS:
            raise ValueError(f"Stack.pipelining = {self.pipelining!r}: expected one of "
                             f"{PIPELININGS}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"Stack.fp8_recipe = {self.fp8_recipe!r}: expected one of "
                             f"{FP8_RECIPES}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Stack.optimizer = {self.optimizer!r}: expected one of "
                             f"{OPTIMIZERS}")
        if not 0 < self.attention_scale <= 1:
            raise ValueError(f"Stack.attention_scale = {self.attention_scale!r}: expected a "
                             "fraction in (0, 1]")


FA1_OVER_FA2 = 32.5 / 50
"""FlashAttention-1's rate over FlashAttention-2's on A100 (Dao 2023, abstract: FA1 25-40%,
FA2's A100 rate as the presets take it, 0.5 of peak): the midpoint of FA1's range over it."""

STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack("megatron-lm", attention_kernel="cudnn", te_fp8=True, embedding_slot=True,
          fp8_recipe="te-delayed",
          cites="Megatron-LM since 2023 (overlap_grad_reduce, "
          "overlap_p2p_comm, Transformer Engine, flash attention; fp8 by TE's delayed "
          "scaling, core/extensions/transformer_engine.py TEDelayedScaling at ee6737da)"),
    Stack("megatron-lm-2022", attention="unfused", grad_overlap=False, tp_overlap=False,
          p2p_overlap=False,
          cites="Megatron-LM f602ac56 (2022-04-11) and the sequence-parallel branch "
          "(739cb43d, 2022-05-24): gradients reduced after the pipeline, synchronous P2P, "
          "materialised scores (Korthikanti et al. 2022, section 4.1); the async TP "
          "backward collectives (16c90445) ordered before the GEMMs only by a no-op "
          "kernel, which bdd97312 (2022-10-14, 'Remove noop used to try to force "
          "scheduling') replaced by CUDA_DEVICE_MAX_CONNECTIONS=1 because 'ordering isn't "
          "imposed by the scheduler': not assured, so priced as not hidden"),
    Stack("megatron-lm-2021", attention="unfused", grad_overlap=False, tp_overlap=False,
          p2p_overlap=False, cites="Megatron-LM aed2f75 (2021-04-11), Narayanan et al. "
          "2021: synchronous TP all-reduce, gradients after the pipeline"),
    Stack("megatron-bridge", grad_bytes=2, attention_kernel="cudnn", te_fp8=True,
          fp8_params=True, embedding_slot=True,
          fp8_recipe="te-current",
          cites="NVIDIA-NeMo/Megatron-Bridge recipes and NeMo "
          "containers: Transformer Engine, flash attention, every overlap on; gradients "
          "reduced in bf16: Megatron-Bridge's performance configs set "
          "`grad_reduce_in_fp32 = False` (scripts/performance/configs/llama3/"
          "llama3_llm_pretrain.py at v0.2.0, configs/llama/llama31_llm_pretrain.py at "
          "v0.5.0, perf_recipes/_common.py `_benchmark_common` at 067f987d), as NeMo 2.0's "
          "performance recipes do (llama3_8b.py, llama3_70b.py, llama31_405b.py "
          "`pretrain_performance_optimizations` at NeMo d2b21556 and 7a8f1cc7, the commits "
          "dgxc-benchmarking v25.04.01 and v25.05 check out; MegatronStrategy copies the "
          "plugin's value into the DDP config, megatron_strategy.py "
          "update_config_with_dtype_overrides); NeMo 1 launcher yamls set "
          "`grad_sync_dtype: bf16` for Apex's distributed_fused_adam, whose contiguous "
          "gradient buffer takes that dtype (dgxc-benchmarking llama3.1_{8b,70b,405b}.yaml "
          "at v25.01 and 1b9bb6b, nemo_megatron/cfg/gpt3_175b_hydra.yaml at 85380ffe; "
          "apex/contrib/optimizers/distributed_fused_adam.py); fp8 primary weights: "
          "Megatron-Bridge's `bf16_with_fp8_current_scaling_mixed` sets "
          "`fp8_param_gather = True` (src/megatron/bridge/training/mixed_precision.py at "
          "v0.3.0), as NeMo 2's `bf16_with_fp8_mixed` does (nemo/collections/llm/recipes/"
          "precision/mixed_precision.py at NeMo 1dd5fa11); the 405B recipe sets "
          "`account_for_embedding_in_pipeline_split` and `..._loss_...` "
          "(src/megatron/bridge/recipes/llama/llama3.py, llama31_405b_pretrain_config, "
          "v0.3.0 and v0.5.0); fp8 by TE's current scaling "
          "(scripts/performance/utils/helpers.py `get_precision_config('fp8_cs')` "
          "at v0.2.0, TE release_v2.9 in its uv.lock); dgxc-benchmarking's NeMo rows name "
          "delayed scaling (NeMo bf16_with_fp8_mixed at d2b21556; NeMo 1 yamls "
          "fp8_amax_history_len 1024)"),
    Stack("torchtitan", kernels="eager", torch_cp=True, logits_bytes=12, tp_logits_bytes=16,
          sp_saves="gathered", pipelining="torch", fp8_gathers=True, optimizer="foreach",
          gather_copy=True,
          cites="pytorch/torchtitan eager: SDPA flash, FSDP2 prefetch (its gathers copied "
          "out on the compute stream), torch context_parallel, foreach AdamW"),
    Stack("torchtitan+compile", torch_cp=True, logits_bytes=12, tp_logits_bytes=16,
          sp_saves="gathered", pipelining="torch", fp8_gathers=True, optimizer="foreach",
          gather_copy=True,
          cites="pytorch/torchtitan with torch.compile: element-wise work fused; the "
          "optimizer and FSDP2 as eager's"),
    Stack("llm-foundry-2023", kernels="eager", attention_scale=FA1_OVER_FA2,
          fsdp_exposed=True, logits_bytes=4, block="mpt",
          cites="mosaicml/llm-foundry attn_impl triton (FA1 class), MPT's block, "
          "flash-attn 1.0.9's fused cross entropy, "
          "Composer v0.16.3 FSDP syncs every micro-batch (larger_mb.md, llm-foundry #543)"),
    Stack("llm-foundry-2024", kernels="eager", fsdp_exposed=True, logits_bytes=4, block="mpt",
          cites="mosaicml/llm-foundry #838 (5e85bd62d, 2024-01), whose "
          "scripts/train/benchmarking/sweep.py produced the README's Large Scale table: "
          "llm-foundry main with the gpu-flash2 extra (flash-attn 2.4.2), `--attn_impl "
          "flash` for 1b, 3b, 7b and 70b (13b and 30b keep `triton`, llm-foundry-2023), "
          "MPT's block, Composer 0.17 (FSDP syncs every micro-batch: trainer.py "
          "`_train_microbatches` at v0.17.2 uses ddp_sync_context for DDP only)"),
    Stack("deepspeed-2021", attention="unfused", grad_overlap=False, tp_overlap=False,
          p2p_overlap=False, gathers="parameter",
          cites="DeepSpeed ZeRO-3 of 2021 with Megatron-LM's layer "
          "(Narayanan et al. 2021, Table 2): its per-parameter collectives are not priced"),
)}

DEFAULT_STACK = "megatron-lm"


def get_stack(name: str) -> Stack:
    """The `STACKS` entry `name`; an unknown name is a ValueError that lists them."""
    if isinstance(name, Stack):
        return name
    if name not in STACKS:
        raise ValueError(f"stack = {name!r} is not in cost.STACKS ({', '.join(STACKS)})")
    return STACKS[name]
