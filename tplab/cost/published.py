"""Published end-to-end training runs, as printed, and the model's error on each.

`RUNS` holds one dict per run: its `source` (paper and table, or repository and file), the
configuration as printed (model, hardware, GPUs, TP/PP/VPP/CP, micro and global batch,
sequence length, precision, recomputation, sharding), what the source prints (`printed`)
and the tokens per second per GPU that follows from it (`measured`), and the `assumed`
fields the source does not print. `compare()` predicts each (`cost.predict`) and returns
its error; docs/VALIDATION.md discusses where and why the model and a run disagree.

How `measured` follows from what is printed:
- an iteration time (Korthikanti 2022 Table 5, dgxc-benchmarking): global batch x sequence
  length / (time x GPUs);
- tokens/s per GPU (llm-foundry's "Throughput (T/s/GPU)", torchtitan's per-GPU "WPS",
  Megatron-Bridge's "Tokens / sec / GPU"): as printed;
- TFLOPs/GPU (Llama 3 Table 4): TFLOPs / `model_flops_per_token` (6N + causal attention),
  a convention the paper does not state (stated as an assumption per row).
"""

from __future__ import annotations

import statistics

from tplab.cost.collectives import collective_time
from tplab.cost.data_parallel import dp_group_hardware
from tplab.cost.shapes import MODELS, BlockShape
from tplab.cost.training_run import TrainingRun, model_flops_per_token, predict

LLAMA3 = "Llama 3 Herd of Models (arXiv 2407.21783v3), Table 4"
KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5"
TITAN = "pytorch/torchtitan docs/performance.md"
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
DGXC = "NVIDIA/dgxc-benchmarking llama3.1/README.md"
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md"
NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473), Tables 1 and 2"
TITAN_H100 = "pytorch/torchtitan docs/performance.md (Llama 3.1, H100 96GB, commit eaea6f6)"

KEYS = ("model", "hardware", "gpus", "tp", "pp", "vpp", "cp", "micro_batch", "global_batch",
        "seq_len", "recompute", "sharding")
FRAMEWORK = {LLAMA3: ("fused", "flash", True, True, True),
             KORTHIKANTI: ("fused", "unfused", False, True, False),
             TITAN: ("eager", "flash", True, True, True),
             FOUNDRY: ("eager", "flash", True, True, True),
             DGXC: ("fused", "flash", True, True, True),
             BRIDGE: ("fused", "flash", True, True, True),
             NARAYANAN: ("fused", "unfused", False, False, False),
             TITAN_H100: ("eager", "flash", True, True, True)}
"""How each source's framework runs a layer (`TrainingRun.kernels`, `.attention`) and
whether it overlaps the gradient reduction with the backward pass (`.grad_overlap`) and
the TP input-gradient collectives with the weight-gradient GEMMs (`.tp_overlap`) and the
pipeline's transfers with the compute (`.p2p_overlap`: Megatron-LM's `_communicate` of
2022, f602ac56, waits on `batch_isend_irecv` and synchronises; `--overlap-p2p-comm` came on
2023-05-31, f9283c5a, after both papers): Meta's
and NVIDIA's stacks fuse (Transformer Engine); torchtitan's numbers are eager PyTorch;
llm-foundry's MPT is PyTorch with flash attention (MPT's Triton kernel, `FOUNDRY_STACK`;
its LayerNorm one kernel: see `tplab.cost.kernels`); Korthikanti et al. 2022 materialise
the attention scores (their section 4.1 and Figure 3). Megatron-LM (NVIDIA/Megatron-LM)
as Narayanan 2021 ran it (commit aed2f75, 2021-04-11): `train_step` (megatron/training.py) calls
`forward_backward_func` and then `allreduce_gradients()`, after the pipeline, and the TP
backward all-reduce is synchronous (megatron/mpu/mappings.py,
`_CopyToModelParallelRegion.backward`: `_reduce(grad_output)`); the async TP all-reduce
behind the weight-gradient GEMM came on 2021-09-02 (16c90445, before Korthikanti 2022),
`--overlap-grad-reduce` on 2023-08-16 (2d5220a4, after both)."""

TORCH_CP = (TITAN_H100,)
"""The sources whose context parallelism is torch's `context_parallel` (torchtitan's, with
its Llama's `repeat_kv` before SDPA, models/llama/model.py at 9dec370):
`TrainingRun(torch_cp=True)`, priced by `training_run.cp_exposed`."""


ZERO3_2021 = (
    "out of the goal set: DeepSpeed's ZeRO-3 of 2021, whose version and settings (buckets, "
    "prefetch, overlap) the paper does not print; at a (near-)fixed global batch its "
    "measured step barely shrinks as the GPUs grow 3.5-4 fold (175B: 82, 67, 67 s on 384, "
    "768, 1536 GPUs; 530B: 256, 180, 184 s on 640, 1120, 2240; `step_seconds`), where the "
    "work per GPU falls four-fold: its per-GPU traffic (one micro-batch per step: 6 bytes "
    "per parameter, whatever the GPU count) moved at 20-36 GB/s beyond the compute, a fifth "
    "to a tenth of what NCCL's rings measure on the same DGX A100 nodes (192 GB/s, "
    "nccl#812): a limit of that implementation, not of the hardware; its per-parameter "
    "collectives (`DEEPSPEED_ZERO3_2021`) at the model's NCCL terms leave +36% to +178% "
    "even with none of them overlapped (`zero3_per_parameter_s`)")
"""Why Narayanan 2021's six ZeRO-3 rows are reported but left out of the goal's median and
worst (`compare`): a checkable property of the rows themselves (tests/test_cost_runs.py)."""


DEEPSPEED_ZERO3_2021 = (
    "DeepSpeed's ZeRO-3 as of Narayanan 2021 (v0.3.13, 12a53b43, 2021-03-16, and v0.3.14, "
    "0cd9abf2, 2021-04-08; ZeRO-3 came on 2021-03-08, #834): one torch.distributed.all_gather "
    "per parameter over every DP rank, each after a torch.cuda.synchronize() "
    "(partition_parameters.py, _allgather_param), waited for before the sub-module runs "
    "(stage3.py, fetch_sub_module -> _synchronize_communication), with the next parameter "
    "prefetched (prefetch_bucket_size 5e7 elements); parameters under "
    "param_persistence_threshold (1e5 elements) stay whole; one reduce_scatter per "
    "parameter's gradient (_reduce_scatter_gradient). Gathers were coalesced on 2021-10-31 "
    "(#1188, v0.5.5), gradient reduce-scatters on 2022-01-20 (#1453)")
"""How DeepSpeed 2021's ZeRO-3 issued its collectives (`zero3_per_parameter_s`)."""

PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed 0.3.13's default `param_persistence_threshold` (stage3.py): smaller parameters
are never partitioned, so never gathered (their gradients are still reduce-scattered)."""


def zero3_per_parameter_s(r: dict) -> dict:
    """One micro-batch's ZeRO-3 collectives of a row as `DEEPSPEED_ZERO3_2021` issues them,
    priced by the model's own NCCL terms (`collective_time`, the DP group's fabric): each
    layer's parameters one call each, gathered twice (forward and backward, as
    `pipeline.data_parallel` counts FSDP) if at least `PERSISTENCE_THRESHOLD` elements, and
    every gradient reduce-scattered: {"calls", "latency_s", "total_s"} (total: latency and
    bytes, as if none of it overlapped)."""
    run = to_run(r)
    shape, n, h, f = run.shape, run.dp, run.shape.hidden, run.shape.ffn_size
    qkv = h + 2 * shape.kv_dim
    params = [h * qkv, h * h, (2 if shape.gated else 1) * h * f, f * h,   # weights
              qkv, h, f, h, h, h, h, h]            # biases and the two norms' weight, bias
    view = dp_group_hardware(run.hw, 1)

    def cost(op, elements):
        return collective_time(op, elements * shape.dtype_bytes, n, view, "auto")

    gathered = [e for e in params if e >= PERSISTENCE_THRESHOLD]
    calls = 2 * len(gathered) + len(params)
    latency = (2 * len(gathered) * cost("all_gather", 0) + len(params)
               * cost("reduce_scatter", 0))
    total = (2 * sum(cost("all_gather", e) for e in gathered)
             + sum(cost("reduce_scatter", e) for e in params))
    return {"calls": shape.layers * calls, "latency_s": shape.layers * latency,
            "total_s": shape.layers * total}


FOUNDRY_STACK = (
    "llm-foundry's H100 and A100 tables ran one software stack: the numbers of both are, row "
    "for row, those of scripts/train/benchmarking/h100new.md (commit beb8dee69, 2023-08), "
    "whose Image column reads mosaicml/pytorch:2.1.0_cu121-nightly20230827 for both GPUs, and "
    "submit_benchmarks.py of the README's commit (b2a43a147) runs llm-foundry v0.3.0 with "
    "attn_impl 'triton' (MPT's flash_attn_triton.py on the triton-pre-mlir fork's sm90 "
    "branch, setup.py), low_precision_layernorm and FSDP FULL_SHARD, MP mode DEFAULT. On "
    "the six configurations both tables ran (`foundry_pairs`: model, GPUs, sequence, "
    "micro-batch, recomputation) the H100 trained 2.1-2.5 x the A100's tokens/s, where the "
    "presets' sustained GEMM rates (mamf-finder's MSMF) are 3.1 x apart and the model, "
    "which meets the A100 rows, gives 2.8-3.0 x: what held that stack on H100 to an "
    "A100-like ratio is no constant of the H100 preset")
"""Why llm-foundry's H100 rows err high (+23% to +73%) while its A100 rows agree: a
property of the published pairs themselves (`foundry_pairs`, tests/test_cost_runs.py)."""


def foundry_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(H100 row, A100 row) of llm-foundry's tables with the same model, GPUs, sequence,
    micro-batch and recomputation (`FOUNDRY_STACK`)."""
    def key(r):
        return r["model"], r["gpus"], r["seq_len"], r["micro_batch"], r["recompute"]
    mine = [r for r in rows if r["source"] == FOUNDRY]
    a100 = {key(r): r for r in mine if r["hardware"] == "A100 SXM"}
    return [(r, a100[key(r)]) for r in mine
            if r["hardware"] == "H100 SXM" and key(r) in a100]


def row(source, where, config, printed, measured, assumed=(), precision="bf16"):
    run = dict(zip(KEYS, config, strict=True))
    kernels, attention, grad_overlap, tp_overlap, p2p_overlap = FRAMEWORK[source]
    return {"source": source, "where": where, **run, "precision": precision,
            "kernels": kernels, "attention": attention, "grad_overlap": grad_overlap,
            "tp_overlap": tp_overlap, "p2p_overlap": p2p_overlap,
            "torch_cp": source in TORCH_CP,
            "printed": printed, "measured": measured, "assumed": tuple(assumed),
            "excluded": ""}


def step_seconds(r: dict) -> float:
    """The measured seconds per optimizer step of a row: global batch x seq over
    (tokens/s/GPU x GPUs)."""
    return r["global_batch"] * r["seq_len"] / (r["measured"] * r["gpus"])


def llama3(gpus, cp, dp, seq, batch_per_dp, tflops):
    tokens = tflops * 1e12 / model_flops_per_token(MODELS["Llama-3.1 405B"].with_(seq=seq))
    return row(LLAMA3, f"{gpus} GPUs, CP {cp}", ("Llama-3.1 405B", "H100 SXM", gpus, 8, 16, 4,
               cp, 1, batch_per_dp * dp, seq, "none", "zero2"), f"{tflops} TFLOPs/GPU",
               tokens, ("micro_batch 1", "vpp 4", "recompute none",
                        "FLOPs per token 6N + causal attention"))


def korthikanti(model, gpus, pp, vpp, mb, gbs, seconds, full):
    label = "full recompute" if full else "present work (selective + SP)"
    return row(KORTHIKANTI, f"{model}, {label}", (model, "A100 SXM", gpus, 8, pp, vpp, 1, mb,
               gbs, 2048, "full" if full else "selective", "zero1"),
               f"{seconds} s per iteration", gbs * 2048 / (seconds * gpus))


def foundry(hw, model, seq, gpus, mb, accum, tps, ac):
    return row(FOUNDRY, f"{hw} table, {model} at {seq}, {gpus} GPUs",
               (f"MPT {model}", "H100 SXM" if hw == "H100 80GB BF16" else "A100 SXM", gpus,
                1, 1, 1, 1, mb, mb * accum * gpus, seq, "full" if ac else "none", "fsdp"),
               f"{tps} T/s/GPU", tps)


def titan(model, batch, ac, wps, seq):
    return row(TITAN, f"{model}, batch {batch}, {ac}", (model, "A100 SXM", 64, 1, 1, 1, 1,
               batch, 64 * batch, seq, {"no": "none", "full": "full", "selective op": "op",
                                        "selective layer": "half_layers"}[ac],
               "fsdp"), f"{wps} WPS", wps,
               ("'selective layer' is torchtitan's AC every second layer",))


def bridge(release, system, model, gpus, gbs, mbs, fsdp, tp, pp, cp, vp, tps):
    hw = {"DGX-GB200": "GB200 NVL72", "DGX-B200": "B200", "DGX-H100": "H100 SXM"}[system]
    return row(BRIDGE, f"{release} container, {system}, {model} FP8-CS", (
        model, hw, gpus, tp, pp, vp, cp, mbs, gbs, 8192, "none", "fsdp" if fsdp else "zero1"),
        f"{tps} Tokens / sec / GPU", tps, ("recompute none", "FP8 current scaling as fp8"),
        precision="fp8")


def narayanan(params, heads, hidden, layers, tp, pp, gpus, batch, tflops, mb=1,
               sharding="ddp", table="Table 1"):
    """A row of Narayanan 2021: its FLOPs per iteration are its equation (3), F = 96 B s l h^2
    (1 + s/(6h) + V/(16 l h)) with s = 2048, V = 51200 (full recomputation counted), so
    tokens/s/GPU = X / (F / (B s))."""
    shape = BlockShape(hidden=hidden, heads=heads, layers=layers, seq=2048, vocab=51200,
                       name=f"GPT {params}B (Narayanan 2021)")
    per_token = 96 * layers * hidden**2 * (1 + 2048 / (6 * hidden)
                                           + 51200 / (16 * layers * hidden))
    r = row(NARAYANAN, f"{table}: GPT {params}B, {gpus} GPUs" + (
        f", ZeRO-3 micro-batch {mb}" if sharding == "fsdp" else ""),
        (shape.name, "A100 SXM", gpus, tp, pp, 1, 1, mb, batch, 2048, "full", sharding),
        f"{tflops} teraFLOP/s per GPU", tflops * 1e12 / per_token,
        ("micro_batch 1" if table == "Table 1" else "", "vpp 1 (not printed)"))
    return r | {"shape": shape, "excluded": ZERO3_2021 if sharding == "fsdp" else ""}


PP_FSDP = ("FSDP under PP runs as ZeRO-1: torch.distributed.pipelining reduces the "
           "gradients on the last micro-batch only and keeps the parameters unsharded between "
           "micro-batches (stage.py, backward_maybe_with_nosync: 'accumulate gradients on "
           "previous steps and reduce them on the last step'), and torchtitan's apply_fsdp: "
           "'For PP, do not reshard after forward to avoid per-microbatch all-gathers, which "
           "can be expensive and non-overlapped'")


PP_MICROBATCHES = ("pipeline micro-batches = the PP degree: torchtitan at the commit the "
                   "tables name (9dec370) splits the local batch into "
                   "--experimental.pipeline_parallel_microbatches, 'The default value will "
                   "be the number of pipeline stages, if unspecified' (config_manager.py; "
                   "build_pipeline_schedule, pipelining_utils.py), and neither the tables "
                   "nor llama3_405b.toml set it")


def titan_h100(table, model, gpus, fsdp, tp, pp, vpp, cp, local, seq, ac, tech, tps):
    """torchtitan's Llama 3.1 tables on Grand Teton H100s: local batch per DP rank (no
    accumulation: the micro-batch; under PP split into `PP_MICROBATCHES`), "selective" AC
    is torchtitan's default op-level SAC, torch.compile fuses the element-wise work."""
    dp = gpus // (tp * pp * cp)
    mb = local // pp if pp > 1 else local
    r = row(TITAN_H100, f"Table {table}: {tech}, {gpus} GPUs (FSDP {fsdp}, TP {tp}, PP {pp}"
            f"{', CP ' + str(cp) if cp > 1 else ''})",
            (model, "H100 96GB (500 W)", gpus, tp, pp, vpp, cp, mb, local * dp, seq,
             "op" if ac == "selective" else "full", "zero1" if pp > 1 else "fsdp"),
            f"{tps} TPS/GPU", tps,
            ("seq_len 8192 (torchtitan's Llama 3.1 8B default)" if seq == 8192 else "",
             "Interleaved 1F1B with 2 stages per rank" if vpp > 1 else "",
             "AsyncTP not modelled" if "AsyncTP" in tech else "",
             PP_FSDP if pp > 1 else "", PP_MICROBATCHES if pp > 1 else ""),
            precision="fp8" if "Float8" in tech else "bf16")
    if "compile" in tech:
        r["kernels"] = "fused"
    return r


RUNS: list[dict] = [
    llama3(8192, 1, 64, 8192, 32, 430),
    llama3(16384, 1, 128, 8192, 16, 400),
    llama3(16384, 16, 8, 131072, 16, 380),
    *[korthikanti(*args, full) for full in (False, True) for args in (
        ("GPT 22B", 8, 1, 1, 4, 4, 1.42 if full else 1.10),
        ("GPT 175B", 64, 8, 3, 1, 64, 18.13 if full else 13.75),
        ("GPT 530B", 280, 35, 3, 1, 280, 49.05 if full else 37.83),
        ("GPT 1T", 512, 64, 1, 1, 512, 94.42 if full else 71.49))],
    row(KORTHIKANTI, "GPT 530B, 8-way DP (section 6.3)", ("GPT 530B", "A100 SXM", 2240, 8, 35,
        3, 1, 1, 2240, 2048, "selective", "zero1"), "39.15 s per iteration",
        2240 * 2048 / (39.15 * 2240), ("DP gradients not overlapped in the paper",)),
    titan("Llama-3 8B", 1, "selective layer", 2904, 8192),
    titan("Llama-3 8B", 1, "selective op", 2973, 8192),
    titan("Llama-3 70B", 1, "full", 331, 8192),
    titan("Llama-2 13B", 2, "no", 2162, 4096),
    titan("Llama-2 13B", 2, "selective layer", 1914, 4096),
    titan("Llama-2 13B", 2, "selective op", 1904, 4096),
    titan("Llama-2 70B", 1, "selective op", 355, 4096),
    titan("Llama-2 70B", 2, "full", 353, 4096),
    *[foundry("H100 80GB BF16", *args) for args in (
        ("70B", 2048, 64, 8, 4, 1039, True), ("70B", 2048, 32, 2, 16, 882, True),
        ("30B", 8192, 8, 1, 21, 1384, True), ("30B", 4096, 8, 1, 21, 1802, True),
        ("30B", 2048, 8, 3, 21, 2002, True), ("13B", 16384, 8, 3, 3, 2985, True),
        ("13B", 4096, 8, 10, 3, 4717, True), ("13B", 2048, 8, 2, 1, 4792, False),
        ("7B", 32768, 8, 2, 2, 3318, True), ("7B", 8192, 8, 8, 2, 6935, True),
        ("7B", 4096, 8, 16, 2, 8611, True), ("7B", 2048, 8, 6, 1, 10643, False),
        ("3B", 2048, 64, 6, 3, 22525, False), ("1B", 2048, 64, 20, 1, 44402, False))],
    *[foundry("A100 80GB", *args) for args in (
        ("70B", 2048, 64, 8, 4, 410, True), ("30B", 2048, 8, 3, 21, 916, True),
        ("13B", 4096, 8, 10, 3, 2060, True), ("13B", 2048, 8, 2, 3, 2262, False),
        ("7B", 8192, 8, 8, 2, 3206, True), ("7B", 2048, 8, 6, 2, 4641, False),
        ("3B", 2048, 8, 10, 2, 10811, False), ("1B", 2048, 8, 14, 4, 20513, False))],
    row(DGXC, "GB200 example, 128 GPUs, GBS 64", ("Llama-3.1 405B", "GB200 NVL72", 128, 4, 8,
        8, 2, 1, 64, 8192, "selective", "zero1"), "9.347 s per step",
        8192 * 64 / (9.347 * 128), ("recompute selective",)),
    # 25.11 NeMo container tables (FSDP > 0: FSDP; VP n/a: 1), dense Llama rows, FP8-CS
    *[bridge("25.11", *args) for args in (
        ("DGX-GB200", "Llama-3 8B", 8, 128, 2, 0, 1, 1, 1, 1, 31508),
        ("DGX-GB200", "Llama-3 70B", 64, 256, 2, 64, 1, 1, 1, 1, 4312),
        ("DGX-GB200", "Llama-3.1 405B", 256, 1536, 1, 0, 4, 16, 1, 4, 813),
        ("DGX-B200", "Llama-3 8B", 8, 128, 2, 0, 1, 1, 1, 1, 30624),
        ("DGX-B200", "Llama-3.1 405B", 128, 64, 1, 0, 4, 8, 2, 8, 661),
        ("DGX-H100", "Llama-3 8B", 8, 128, 1, 8, 1, 1, 1, 1, 14451),
        ("DGX-H100", "Llama-3 70B", 64, 128, 1, 0, 4, 8, 1, 5, 1602),
        ("DGX-H100", "Llama-3.1 405B", 1024, 512, 1, 0, 8, 8, 2, 8, 292))],
    # Narayanan 2021 Table 1 (weak scaling) and Table 2 (PTD-P and ZeRO-3 without MP)
    narayanan(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    narayanan(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    narayanan(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    narayanan(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    narayanan(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    narayanan(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    narayanan(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    narayanan(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    narayanan(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    narayanan(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    *[narayanan(174.6, 96, 12288, 96, 8, 12, g, 1536, x, table="Table 2")
      for g, x in ((384, 153), (768, 149), (1536, 141))],
    *[narayanan(529.6, 128, 20480, 105, 8, 35, g, 2240, x, table="Table 2")
      for g, x in ((560, 171), (1120, 167), (2240, 159))],
    *[narayanan(174.6, 96, 12288, 96, 1, 1, g, 1536, x, mb, "fsdp", "Table 2")
      for g, mb, x in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))],
    *[narayanan(529.6, 128, 20480, 105, 1, 1, g, b, x, mb, "fsdp", "Table 2")
      for g, b, mb, x in ((640, 2560, 4, 138), (1120, 2240, 2, 98), (2240, 2240, 1, 48))],
    # torchtitan's Llama 3.1 tables on H100 96GB / 500 W (FSDP, CP, TP, PP, Float8, compile)
    *[titan_h100(t, "Llama-3 8B", g, g, 1, 1, 1, 1, 2, 8192, "selective", tech, x)
      for t, g in ((1, 8), (3, 128)) for tech, x in (
          ("FSDP", {1: 5762, 3: 5605}[t]), ("FSDP + torch.compile", {1: 6667, 3: 6514}[t]),
          ("FSDP + torch.compile + Float8", {1: 8532, 3: 8380}[t]))],
    *[titan_h100(2, "Llama-3 8B", 8, 8 // cp, 1, 1, 1, cp, 1, seq, "full",
                 "FSDP + CP + torch.compile + Float8", x)
      for cp, seq, x in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071),
                         (8, 262144, 548))],
    *[titan_h100(4, "Llama-3 70B", 256, 32, 8, 1, 1, 1, 16, 8192, "full",
                 f"{tech} + torch.compile + Float8", x)
      for tech, x in (("2D", 829), ("2D + AsyncTP", 876))],
    *[titan_h100(5, "Llama-3.1 405B", 512, 8, 8, 8, vpp, 1, 32, 8192, "full",
                 f"{name}, torch.compile + Float8 + AsyncTP", x)
      for name, vpp, x in (("1F1B", 1, 100), ("Interleaved 1F1B", 2, 128))],
    *[titan_h100(6, "Llama-3.1 405B", 512, 8 // cp, 8, 8, 1, cp, 8, seq, "full",
                 "4D, torch.compile + Float8 + AsyncTP + 1F1B", x)
      for cp, seq, x in ((1, 32768, 76), (2, 65536, 47), (4, 131072, 31), (8, 262144, 16))],
    # 26.02 NeMo container tables, FP8 rows of a layout or batch the 25.11 ones do not have
    *[bridge("26.02", *args) for args in (
        ("DGX-H100", "Llama-3 70B", 64, 256, 1, 0, 4, 8, 1, 5, 1621),
        ("DGX-H100", "Llama-3.1 405B", 1024, 1536, 1, 0, 8, 8, 2, 8, 311))],
]


def to_run(r: dict) -> TrainingRun:
    """The `TrainingRun` a published row describes."""
    return TrainingRun(r.get("shape", r["model"]), r["hardware"], r["gpus"], tp=r["tp"], pp=r["pp"],
                       vpp=r["vpp"], cp=r["cp"], micro_batch=r["micro_batch"],
                       global_batch=r["global_batch"], seq_len=r["seq_len"],
                       precision=r["precision"], recompute=r["recompute"],
                       sharding=r["sharding"], kernels=r["kernels"],
                       attention=r["attention"], grad_overlap=r["grad_overlap"],
                       tp_overlap=r["tp_overlap"], torch_cp=r["torch_cp"],
                       p2p_overlap=r["p2p_overlap"])


def compare(runs: list[dict] | None = None) -> dict:
    """Each run's prediction and error ((predicted - measured) / measured, tokens/s/GPU),
    with the median and worst |error| over the goal set (the rows whose `excluded` is
    empty; `ZERO3_2021` says why six are not) and over every row ("median_all",
    "worst_all"): {"rows": [...], "median": ..., "worst": ..., "worst_row": ..., ...}."""
    rows = []
    for r in RUNS if runs is None else runs:
        p = predict(to_run(r))
        rows.append(r | {"predicted": p.tokens_per_s_per_gpu, "mfu": p.mfu,
                         "error": p.tokens_per_s_per_gpu / r["measured"] - 1,
                         "fits": p.fits, "memory_gb": p.memory_per_gpu / 1e9})
    goal = [r for r in rows if not r.get("excluded")] or rows
    worst = max(goal, key=lambda r: abs(r["error"]))
    worst_all = max(rows, key=lambda r: abs(r["error"]))
    return {"rows": rows, "goal_rows": len(goal),
            "median": statistics.median(abs(r["error"]) for r in goal),
            "worst": worst["error"], "worst_row": worst,
            "median_all": statistics.median(abs(r["error"]) for r in rows),
            "worst_all": worst_all["error"], "worst_all_row": worst_all}
