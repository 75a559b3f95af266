"""Published end-to-end training runs, as printed, and the model's error on each.

The runs are data: one JSON file per source in tplab/cost/data/ (the source, its
repository or paper, the commit or version, the file and tables, and every row of each
table used, read by scripts/read_published_tables.py where the source is a repository).
`RUNS` holds one dict per row: its `source`, the configuration as printed (model,
hardware, GPUs, TP/PP/VPP/CP, micro and global batch, sequence length, precision,
recomputation, sharding), the `stack` it ran (`cost.STACKS`), what the source prints
(`printed`) and the tokens per second per GPU that follows from it (`measured`), the
`assumed` fields the source does not print, and `peak_gib` where the source prints the
peak memory. `excluded` is what `exclusion` (the one rule, declared before scoring) says
of the row. `compare()` predicts each (`cost.predict`; a setting the source does not
print is the one that fits, `fitting`) and returns its error; `tplab.cost.scores`
the figures of the goal, over all rows and over the goal set; docs/VALIDATION.md
discusses where and why the model and a run disagree.

How `measured` follows from what is printed:
- an iteration time (Korthikanti 2022 Table 5, dgxc-benchmarking): global batch x sequence
  length / (time x GPUs);
- tokens/s per GPU (llm-foundry's "Throughput (T/s/GPU)", torchtitan's per-GPU "WPS",
  Megatron-Bridge's "Tokens / sec / GPU"): as printed;
- TFLOPs/GPU (Llama 3 Table 4): TFLOPs / `model_flops_per_token` (6N + causal attention),
  a convention the paper does not state (stated as an assumption per row).
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

from tplab.cost.collectives import collective_time
from tplab.cost.data_parallel import dp_group_hardware
from tplab.cost.pipeline import NCCL_RESERVE
from tplab.cost.shapes import BlockShape
from tplab.cost.training_run import TrainingRun, predict

LLAMA3 = "Llama 3 Herd of Models (arXiv 2407.21783v3), Table 4"
KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5"
TITAN = ("pytorch/torchtitan docs/performance.md (64 A100 80GB; Llama 3.1 405B on 128 "
         "H100)")
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
DGXC = "NVIDIA/dgxc-benchmarking recipe READMEs"
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md"
NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473), Tables 1 and 2"
TITAN_H100 = "pytorch/torchtitan docs/performance.md (Llama 3.1, H100 96GB, commit eaea6f6)"

DATA = Path(__file__).with_name("data")
KEYS = ("model", "hardware", "gpus", "tp", "pp", "vpp", "cp", "micro_batch", "global_batch",
        "seq_len", "recompute", "sharding")


def load(path: Path) -> list[dict]:
    """The rows of one source's data file, each with the file's source, commit and file."""
    data = json.loads(path.read_text())
    out = []
    for r in data["rows"]:
        row = {"source": data["source"], "commit": data["commit"], "file": data["file"],
               "peak_gib": None, **r, "assumed": tuple(r.get("assumed", ()))}
        if isinstance(r["model"], dict):
            spec = dict(r["model"])
            row["model"] = spec["name"]
            row["shape"] = BlockShape(**spec)
        out.append(row)
    return out


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
    "the configurations both tables ran (`foundry_pairs`: model, GPUs, sequence, "
    "micro-batch, recomputation) the H100 trained 1.8-2.6 x the A100's tokens/s, where the "
    "presets' sustained GEMM rates (mamf-finder's MSMF: 8 H200s at the power cap, and the "
    "A100 PCIe's) are 2.85 x apart and the model, with the attention kernels' measured "
    "rates, gives 2.1-2.6 x (a median 8% above each pair): what held that stack on H100 to an "
    "A100-like ratio is no constant of the H100 preset read so far (docs/VALIDATION.md, "
    "rounds fourteen and fifteen)")
"""Why llm-foundry's H100 rows err high while its A100 rows agree: a property of the
published pairs themselves (`foundry_pairs`, tests/test_cost_runs.py)."""


def foundry_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(H100 row, A100 row) of llm-foundry's tables with the same model, GPUs, sequence,
    micro-batch and recomputation (`FOUNDRY_STACK`)."""
    def key(r):
        return (r["model"], r["gpus"], r["seq_len"], r["micro_batch"], r["recompute"],
                r["precision"])
    mine = [r for r in rows if r["source"] == FOUNDRY]
    a100 = {key(r): r for r in mine if r["hardware"] == "A100 SXM"}
    return [(r, a100[key(r)]) for r in mine
            if r["hardware"] == "H100 SXM" and key(r) in a100]


def foundry_disagreeing(rows: list[dict]) -> list[dict]:
    """llm-foundry A100 rows whose own table contradicts them: the H100 / A100 throughput
    ratio of their pair (`foundry_pairs`, the same configuration on both GPUs, one image)
    lies more than 3 median absolute deviations from the median over every pair (39 pairs:
    1.81-2.53 but for 760M at 1024 and 512 tokens, 2.64 and 2.84, where the 760M sweep's
    other five pairs give 1.85-2.03). A rule on the measurements alone, not on the model."""
    pairs = foundry_pairs(rows)
    if len(pairs) < 5:
        return []
    ratio = [h["measured"] / a["measured"] for h, a in pairs]
    mid = statistics.median(ratio)
    mad = statistics.median(abs(x - mid) for x in ratio)
    return [a for (_, a), x in zip(pairs, ratio, strict=True) if abs(x - mid) > 3 * mad]


def slower_with_less_work(rows: list[dict]) -> list[dict]:
    """Rows their own sweep contradicts: a row measured slower than a row of the same
    source, model, hardware, GPUs, layout, stack, precision and recomputation at a longer
    sequence with the same tokens per micro-batch and per step. Such a row does the other's
    work with less attention (the same GEMMs, collectives and micro-batches; attention's
    score FLOPs in proportion to the sequence), so it should not take longer (only
    per-sequence costs grow). Over every source's 133 such pairs this finds llm-foundry's
    760M A100 rows at 1024 and 512 tokens (29,765 and 29,446 tokens/s/GPU against 32,434 at
    2048; its 1B, 350M and 125M sweeps rise 7.8-10.4% from 2048 to 1024). A rule on the
    measurements alone, not on the model."""
    def same(r):
        return (r["source"], r["hardware"], str(r["model"]), r["gpus"], r["stack"],
                r["precision"], r["recompute"], r["tp"], r["pp"], r["vpp"], r["cp"],
                r["sharding"])

    def tokens(r):
        return r["micro_batch"] * r["seq_len"], r["global_batch"] * r["seq_len"]

    return [a for a in rows
            if any(same(b) == same(a) and b["seq_len"] > a["seq_len"]
                   and tokens(b) == tokens(a) and b["measured"] > a["measured"]
                   for b in rows)]


def step_seconds(r: dict) -> float:
    """The measured seconds per optimizer step of a row: global batch x seq over
    (tokens/s/GPU x GPUs)."""
    return r["global_batch"] * r["seq_len"] / (r["measured"] * r["gpus"])


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


UNPRICED = ("AsyncTP", "Async TP")
"""Printed techniques `TrainingRun` has no field for (torchtitan's async TP: micro-pipelined
all-gather/reduce-scatter matmuls)."""
UNPRICED_STATES = ("bf16 PURE",)
"""Printed precision modes whose states `TrainingRun` does not count: llm-foundry's "PURE"
mixed precision keeps bf16 parameters, gradients and optimizer state (FSDP
`MixedPrecision` PURE in llm-foundry), where the model counts fp32 master weights and
moments; the rule that left llm-foundry's whole A100 40GB table out (docs/VALIDATION.md),
applied to the two A100 80GB rows that print it (re-added by 722c6c43f)."""


def exclusion(r: dict) -> str:
    """Why a row is left out of the goal set ("" if it is in): the rule reads the row only,
    and was declared before scoring (docs/VALIDATION.md, "Frozen protocol"). Two reasons:
    the row ran a stack whose collectives the model does not price (`ZERO3_2021`), or it
    prints a technique `TrainingRun` has no field for (`UNPRICED`) or states it does not
    count (`UNPRICED_STATES`)."""
    if r["stack"] == "deepspeed-2021":
        return ZERO3_2021
    named = [t for t in UNPRICED if t in r["where"]]
    named += [t for t in UNPRICED_STATES if t in r.get("printed", "")]
    if named:
        return f"out of the goal set: prints {named[0]}, which TrainingRun cannot express"
    return ""


def unexpressible(r: dict) -> str:
    """Why `TrainingRun` cannot express a row at all ("" if it can): a printed model with
    no `cost.MODELS` shape (mixture-of-experts; dgxc's Nemotron-4), a system with no
    `cost.HARDWARE` preset (GB300, B300) or a precision the model does not price (MXFP8,
    NVFP4: block-scaled formats; the model's fp8 is tensorwise). Such rows stay in the
    data, counted and listed (`UNSCORED`), and are not scored."""
    if r["model"] is None:
        return f"model {r.get('printed_model')!r}: no cost.MODELS shape"
    if r["hardware"] is None:
        return f"system {r.get('printed_system')!r}: no cost.HARDWARE preset"
    if r["precision"] is None:
        return f"precision {r.get('printed_precision')!r}: not priced"
    return ""


ROWS: list[dict] = [r for path in sorted(DATA.glob("*.json")) for r in load(path)]
"""Every row of every data file, scored or not."""
RUNS: list[dict] = [r | {"excluded": exclusion(r)} for r in ROWS if not unexpressible(r)]
"""The rows `TrainingRun` can express: every one is scored."""
UNSCORED: list[tuple[dict, str]] = [(r, unexpressible(r)) for r in ROWS if unexpressible(r)]


def to_run(r: dict, **changes) -> TrainingRun:
    """The `TrainingRun` a published row describes (its stack, and its fp8 recipe where
    the row names one, included); `changes` replace fields, e.g. another stack."""
    fields = {k: r[k] for k in KEYS} | {"precision": r["precision"], "stack": r["stack"]}
    fields["model"] = r.get("shape", r["model"])
    if r.get("fp8_recipe"):         # a recipe the row's source names (Stack.fp8_recipe)
        fields["fp8_recipe"] = r["fp8_recipe"]
    if r.get("expandable_segments"):   # the allocator setting its recipe sets (data file)
        fields["expandable_segments"] = True
    return TrainingRun(**(fields | changes))


TRIED = {"recompute": ("none", "selective", "full"), "vpp": (4, 3, 2, 1)}
"""What `fitting` tries for a field the source does not print, in order."""


def unprinted(r: dict) -> list[str]:
    """The fields of `TRIED` a row's `assumed` list says the source does not print
    ("recompute none", "vpp 4")."""
    return [k for k in TRIED if any(a.split(" ")[0] == k for a in r["assumed"])]


def tried(r: dict, name: str) -> tuple:
    """The values `fitting` tries for an unprinted field: `TRIED`'s, or those the row's
    source leaves open (its "tried" entry: Llama 3's "interleaved schedule with V pipeline
    stages" leaves V >= 2)."""
    return tuple(r.get("tried", {}).get(name, TRIED[name]))


def fitting(r: dict, **changes) -> tuple[dict, object]:
    """The unprinted settings the row ran with, and its prediction: the assumed ones if they
    fit, else, of the combinations of `TRIED` values that fit, the fastest (what a recipe
    tuned for throughput would pick); ({}, the assumed run's prediction) if none fits: the
    model then says the run could not have run."""
    first = predict(to_run(r, **changes))
    fields = unprinted(r)
    if first.fits or not fields:
        return {}, first
    best: tuple[dict, object] = ({}, first)
    for vals in itertools.product(*(tried(r, k) for k in fields)):
        setting = dict(zip(fields, vals, strict=True))
        try:
            p = predict(to_run(r, **(changes | setting)))
        except ValueError:
            continue
        if p.fits and (not best[1].fits
                       or p.tokens_per_s_per_gpu > best[1].tokens_per_s_per_gpu):
            best = (setting, p)
    return best


def allocator_reserved(p) -> float:
    """What torch's caching allocator holds at the prediction's peak: its bytes less what
    lives outside the allocator (`pipeline.NCCL_RESERVE`, NCCL's buffers, and
    `Hardware.memory_reserve`, the CUDA context). torchtitan's tables print this
    (train.py at 9dec370 logs `device_mem_stats.max_reserved_gib`, metrics.py's
    `reserved_bytes.all.peak` of `torch.cuda.memory_stats`), not the GPU's whole use."""
    return p.memory_per_gpu - NCCL_RESERVE - p.run.hw.memory_reserve


def compare(runs: list[dict] | None = None, **changes) -> dict:
    """Each run's prediction and error ((predicted - measured) / measured, tokens/s/GPU),
    with the median and worst |error| over the goal set (the rows `exclusion` leaves in)
    and over every row ("median_all", "worst_all"): {"rows": [...], "median": ...,
    "worst": ..., "worst_row": ..., ...}. `changes` go to every row's `TrainingRun`."""
    rows = []
    for r in RUNS if runs is None else runs:
        setting, p = fitting(r, **changes)
        assumed = predict(to_run(r, **changes)) if setting else p
        rows.append(r | setting | {"fit_setting": setting,
                                   "error_assumed": assumed.tokens_per_s_per_gpu
                                   / r["measured"] - 1,
                                   "predicted": p.tokens_per_s_per_gpu, "mfu": p.mfu,
                         "error": p.tokens_per_s_per_gpu / r["measured"] - 1,
                         "fits": p.fits, "memory_gib": p.memory_per_gpu / 2**30,
                         "reserved_gib": allocator_reserved(p) / 2**30,
                         "priced_stack": p.stack})
    goal = [r for r in rows if not r.get("excluded")] or rows
    worst = max(goal, key=lambda r: abs(r["error"]))
    worst_all = max(rows, key=lambda r: abs(r["error"]))
    return {"rows": rows, "goal_rows": len(goal),
            "median": statistics.median(abs(r["error"]) for r in goal),
            "worst": worst["error"], "worst_row": worst,
            "median_all": statistics.median(abs(r["error"]) for r in rows),
            "worst_all": worst_all["error"], "worst_all_row": worst_all}
