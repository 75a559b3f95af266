"""Every constant or choice made while the published errors were visible, with what the
alternative gives (docs/VALIDATION.md, "Frozen protocol"):

    scripts/env.sh python benchmarks/published_choices.py
    scripts/env.sh python benchmarks/published_choices.py --before   # issue 26's model

`--before` prices the same rows with every term issue 35 added switched off at once
(llm-foundry at FA2's rate with its FSDP traffic hidden, `recompute="op"` as Korthikanti's
selective in memory and half the GEMMs in time, 8 bytes per logit, fp32 gradients on every
stack, fp8 quantised unfused on every stack, rows priced as assumed whether they fit or
not) and prints the goal figures: the
"before" of docs/VALIDATION.md.

For each: the median |error| over all rows, the source(s) the choice was read from, and
every source held out (`tplab.cost.scores.leave_one_source_out`, "after"), as chosen and
as the alternative. No GPU is needed.
"""

import contextlib
import dataclasses
import sys

from tplab.cost import (
    attention_rates,
    hardware,
    kernels,
    memory,
    pipeline,
    predict,
    published,
    scores,
    stacks,
)
from tplab.cost.hardware import HARDWARE


@contextlib.contextmanager
def stack_as(name: str, **changes):
    old = stacks.STACKS[name]
    stacks.STACKS[name] = dataclasses.replace(old, **changes)
    try:
        yield
    finally:
        stacks.STACKS[name] = old


@contextlib.contextmanager
def hardware_as(name: str, **changes):
    old = HARDWARE[name]
    HARDWARE[name] = old.with_(**changes)
    try:
        yield
    finally:
        HARDWARE[name] = old


@contextlib.contextmanager
def presets_as(names, change):
    """Each preset in `names` with the fields `change(hw)` returns."""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(hardware_as(name, **change(HARDWARE[name])))
        yield


@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def uncapped_in_flight(pp: int, vpp: int, m: int) -> float:
    """Round eleven's count: p + (p - 1) / v micro-batches even when m is fewer."""
    if pp == 1:
        return 1.0
    return min(pp, m) * (1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1)


GB200_405B_FP8_CS = [r for r in published.RUNS if r["source"] == published.BRIDGE
                     and r["hardware"] == "GB200 NVL72" and r["model"] == "Llama-3.1 405B"
                     and r["precision"] == "fp8"]
"""Megatron-Bridge's GB200 405B FP8 rows: LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V2
(scripts/performance/configs/llama/llama31_workload_base_configs.py, v0.3.0 to v0.5.0)
sets no recomputation and no offload."""


@contextlib.contextmanager
def runs_as(change):
    old = list(published.RUNS)
    published.RUNS[:] = [change(r) for r in old]
    try:
        yield
    finally:
        published.RUNS[:] = old


def figures() -> dict:
    s = scores.score()
    return {"median": s["all"]["median"], "p90": s["all"]["p90"],
            "goal": s["goal"]["median"], "signed": s["all"]["signed"],
            "loso": {k: v["after"] for k, v in s["loso_goal"].items()},
            "memory": s["memory"]["within_10"], "peaks": len(s["memory"]["rows"]),
            "not_fit": len(s["memory"]["not_fitting"])}


def show(name: str, chosen: dict, other: dict, sources: tuple[str, ...],
         every_source: bool = False) -> None:
    print(f"\n{name}")
    for label, f in (("chosen", chosen), ("alternative", other)):
        read = ", ".join(f"{s.split(' ')[0][:24]} {f['signed'][s]:+.1%}" for s in sources
                         ) or "every source (below)"
        worst = max(f["loso"].values())
        print(f"  {label:11s} median |error| {f['median']:5.1%} (goal set {f['goal']:5.1%}), "
              f"p90 {f['p90']:5.1%}; read "
              f"from: {read}; held out, worst source {worst:5.1%}; peaks within 10% "
              f"{f['memory']}/{f['peaks']}, runs not fitting {f['not_fit']}")
    for src in chosen["loso"] if every_source else ():
        print(f"    {src[:44]:44s} signed (all rows) {chosen['signed'][src]:+6.1%} / "
              f"{other['signed'][src]:+6.1%}, held out (goal set) {chosen['loso'][src]:5.1%}"
              f" / {other['loso'][src]:5.1%} (chosen / alternative)")


@contextlib.contextmanager
def unfused_fp8():
    """Round fourteen's alternative: every stack's fp8 as torchao's unfused recipe, the
    dgxc rows' delayed scaling dropped (`Stack.fp8_recipe`), parameters gathered in bf16."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(pipeline, "FP8_PARAM_BYTES", pipeline.PARAM))
        for name, s in stacks.STACKS.items():
            if s.fp8_recipe != "unfused":
                stack.enter_context(stack_as(name, fp8_recipe="unfused"))
        stack.enter_context(runs_as(lambda r: {k: v for k, v in r.items()
                                               if k != "fp8_recipe"}))
        yield


@contextlib.contextmanager
def issue_26_model():
    """Every term issue 35 added, switched off (module doc)."""
    layer_bytes, recomputed = pipeline.layer_bytes, kernels.op_sac_recomputed_gemms
    fitting = published.fitting
    pipeline.layer_bytes = lambda run, local, rc: layer_bytes(
        run, local, "selective" if rc == "op" else rc)
    kernels.op_sac_recomputed_gemms = lambda shape, tokens, tp: kernels.linear_gemms(
        shape, tokens // 2, tp)
    published.fitting = lambda r, **changes: ({}, predict(published.to_run(r, **changes)))
    try:
        with stack_as("llm-foundry-2023", attention_scale=1.0, fsdp_exposed=False,
                      logits_bytes=8, block="megatron"), \
                stack_as("torchtitan", logits_bytes=8, tp_logits_bytes=0, sp_saves="shard"), \
                stack_as("torchtitan+compile", logits_bytes=8, tp_logits_bytes=0,
                         sp_saves="shard"), \
                stack_as("deepspeed-2021", gathers="layer"), fsdp_states_as(2, 12), \
                stack_as("megatron-bridge", grad_bytes=4), peaks_as_total(), unfused_fp8():
            yield
    finally:
        pipeline.layer_bytes, kernels.op_sac_recomputed_gemms = layer_bytes, recomputed
        published.fitting = fitting


@contextlib.contextmanager
def fsdp_states_as(param: int, states: int):
    """FSDP's bytes per parameter: 4 and 8 (`memory.MASTER_IS_SHARD`, the fp32 shard is
    the master) or 2 and 12, ZeRO's bf16 parameter and fp32 master, m, v (issue 26's
    count)."""
    if (param, states) not in ((4, 8), (2, 12)):
        raise ValueError(f"fsdp_states_as({param}, {states}): expected (4, 8) or (2, 12)")
    old = memory.MASTER_IS_SHARD
    memory.MASTER_IS_SHARD = param == 4
    try:
        yield
    finally:
        memory.MASTER_IS_SHARD = old


@contextlib.contextmanager
def peaks_as_total():
    """Printed peaks compared with the model's whole bytes per GPU (issue 26's comparison),
    not with what the allocator reserves (`published.allocator_reserved`)."""
    old = published.allocator_reserved
    published.allocator_reserved = lambda p: p.memory_per_gpu
    try:
        yield
    finally:
        published.allocator_reserved = old


def before() -> None:
    with issue_26_model():
        s = scores.score()
    for way in ("all", "goal"):
        e, (good, total) = s[way], s[f"pairs_{way}"]
        print(f"{way} ({e['rows']} rows): median |error| {e['median']:.1%}, p90 "
              f"{e['p90']:.1%}, pairs ordered {good / total:.1%}")
        for src, m in e["signed"].items():
            lo = s[f"loso_{way}"][src]
            print(f"  {src[:50]:50s} signed {m:+.1%}, held out {lo['before']:.1%} -> "
                  f"{lo['after']:.1%}")
    k, m = s["korthikanti"], s["memory"]
    print(f"Korthikanti's 8 runs: mean {k['mean']:.2%}, max {k['max']:.2%}; peaks within 10%: "
          f"{m['within_10']}/{len(m['rows'])} (worst {m['worst']:+.0%}); runs not fitting "
          f"{len(m['not_fitting'])}; over 25% {len(s['over'])}, unexplained "
          f"{sum(why == 'unexplained' for _, why in s['over'])}")


def main() -> None:
    if "--before" in sys.argv[1:]:
        before()
        return
    base = figures()
    a100, titan_h100 = published.FOUNDRY, published.TITAN_H100   # noqa: F841
    with stack_as("llm-foundry-2023", attention_scale=1.0):
        show("llm-foundry-2023 attention at FA1's rate (0.65 x FA2) vs FA2's", base,
             figures(), (a100,))
    with stack_as("llm-foundry-2023", fsdp_exposed=False):
        show("llm-foundry-2023 FSDP sync exposed per micro-batch vs hidden", base, figures(),
             (a100,))
    with stack_as("torchtitan", logits_bytes=10), stack_as("torchtitan+compile",
                                                           logits_bytes=10):
        show("torchtitan's loss peaks at 12 bytes per logit (backward) vs 10 (forward)", base,
             figures(), (titan_h100,))
    with stack_as("torchtitan", tp_logits_bytes=0), stack_as("torchtitan+compile",
                                                             tp_logits_bytes=0):
        show("torchtitan's loss under TP at loss_parallel's 16 bytes per logit vs 12 "
             "(ATen's fused backward)", base, figures(), (titan_h100,))
    with stack_as("torchtitan", sp_saves="shard"), stack_as("torchtitan+compile",
                                                            sp_saves="shard"):
        show("torchtitan's TP keeps each linear's gathered input vs Megatron's 1/t shard",
             base, figures(), (titan_h100,))
    with stack_as("llm-foundry-2023", block="megatron"):
        show("llm-foundry-2023: MPT's block (mpt_layer) vs Korthikanti's GPT layer", base,
             figures(), (a100,))
    with stack_as("llm-foundry-2023", logits_bytes=8):
        show("llm-foundry-2023: flash-attn's fused loss, 4 bytes per logit vs 8", base,
             figures(), (a100,))
    with stack_as("megatron-lm-2022", tp_overlap=True):
        show("megatron-lm-2022: TP backward collectives not hidden (a no-op kernel, not the "
             "scheduler, ordered them) vs hidden", base, figures(), (published.KORTHIKANTI,))
    with fsdp_states_as(2, 12):
        show("FSDP: the fp32 shard as master (16 bytes a parameter) vs 18", base, figures(),
             (a100, titan_h100))
    with stack_as("deepspeed-2021", gathers="layer"):
        show("deepspeed-2021: one parameter gathered at a time vs two layers", base,
             figures(), (published.NARAYANAN,))
    with stack_as("megatron-bridge", grad_bytes=4):
        show("megatron-bridge (NeMo 1 yamls, NeMo 2 and Megatron-Bridge recipes): "
             "gradients reduced in bf16 vs fp32", base, figures(),
             (published.BRIDGE, published.DGXC))
    te_fp8 = (published.DGXC, published.BRIDGE)
    with unfused_fp8():
        show("fp8 on Transformer Engine's stacks as TE quantises (weights once a step, the "
             "norm's output in fp8, no amax pass under delayed scaling, fp8 TP all-gathers "
             "and parameter gather) vs every operand's amax pass and cast each micro-batch "
             "(torchao's tensorwise recipe)", base, figures(), te_fp8, every_source=True)
    with patched(kernels, "FP8_TP_ROLES", dict.fromkeys(kernels.FP8_TP_ROLES, ())):
        show("TE fp8: TP all-gathers (and delayed scaling's fp8_buf reduce-scatter) in fp8 "
             "vs in bf16", base, figures(), te_fp8, every_source=True)
    with patched(pipeline, "FP8_PARAM_BYTES", pipeline.PARAM):
        show("TE fp8: the distributed optimizer gathers fp8 parameters (1 byte) vs bf16",
             base, figures(), te_fp8)
    with runs_as(lambda r: {k: v for k, v in r.items() if k != "fp8_recipe"}):
        show("dgxc-benchmarking's FP8 rows at NeMo's delayed scaling vs the megatron-bridge "
             "stack's current scaling", base, figures(), (published.DGXC,))
    with patched(pipeline, "in_flight", uncapped_in_flight):
        show("interleaved 1F1B holds at most the m micro-batches there are (the warm-up "
             "capped at all m v chunk-forwards) vs p + (p - 1) / v", base, figures(),
             (published.LLAMA3, titan_h100))
    megatron = ("megatron-lm", "megatron-bridge")
    te_rounds = (published.BRIDGE, published.DGXC, published.LLAMA3)
    with stack_as(megatron[0], te_fp8=False), stack_as(megatron[1], te_fp8=False):
        show("Transformer Engine keeps every linear's input in fp8 (FC2's SwiGLU output at 1 "
             "byte, the projection's fp8 copy) vs the QKV and FC1 inputs only", base,
             figures(), te_rounds, every_source=True)
    with stack_as("megatron-bridge", fp8_params=False):
        show("fp8 primary weights (fp8_param_gather) at 1 byte on Blackwell vs bf16", base,
             figures(), te_rounds, every_source=True)
    with stack_as(megatron[0], embedding_slot=False), \
            stack_as(megatron[1], embedding_slot=False):
        show("Megatron's most loaded rank under the embedding/loss split (its schedule, its "
             "parameters) vs the first stage's ceil(L / p) x in-flight", base, figures(),
             te_rounds, every_source=True)
    with stack_as(megatron[0], te_fp8=False, embedding_slot=False), \
            stack_as(megatron[1], te_fp8=False, fp8_params=False, embedding_slot=False):
        show("round fourteen's three memory readings vs none of them", base, figures(),
             te_rounds, every_source=True)
    with runs_as(lambda r: r | {"assumed": tuple(a for a in r["assumed"]
                                                 if a != "recompute none")}
                 if r in GB200_405B_FP8_CS else r):
        show("Megatron-Bridge's GB200 405B FP8 rows at their V2 config's setting (no "
             "recomputation, read at v0.2.1-v0.5.0) vs the fitting fallback (not kept: the "
             "model is 0.06 GiB over the card there)", base, figures(), te_rounds,
             every_source=True)
    with patched(pipeline, "torch_cp_backward_bytes", lambda run: 0.0):
        show("torch context_parallel's backward: K/V all-gathered whole and fp32 gradient "
             "buffers vs none", base, figures(), (titan_h100,))
    titans = ("torchtitan", "torchtitan+compile")
    with stack_as(titans[0], pipelining="megatron"), stack_as(titans[1],
                                                               pipelining="megatron"):
        show("torchtitan's PP: every rank through torch's schedule with PipelineStage's "
             "buffers, outputs and the last stage's logits, the largest taken (pp_ranks) vs "
             "the first stage's in-flight micro-batches", base, figures(), (titan_h100,),
             every_source=True)
    with stack_as(titans[0], fp8_gathers=False), stack_as(titans[1], fp8_gathers=False):
        show("torchtitan's fp8: FSDP's fp8-gathered linear weights at 1 byte (kept gathered "
             "under PP) vs bf16's 2", base, figures(), (titan_h100,), every_source=True)
    with peaks_as_total():
        show("peaks compared as allocator-reserved bytes vs the model's whole bytes", base,
             figures(), (titan_h100,))
    for name in ("H100 SXM", "H100 96GB (500 W)", "A100 SXM", "B200", "GB200 NVL72"):
        on = tuple(dict.fromkeys(r["source"] for r in published.RUNS
                                 if r["hardware"] == name))
        with hardware_as(name, sustained=1.0):
            show(f"{name}: sustained (MSMF / MAMF) vs 1 (MAMF alone)", base, figures(), on)
    every = tuple(HARDWARE)
    with presets_as(every, lambda hw: {"memory_efficiency": 1.0}):
        show("memory-bound work at the copy's fraction of the datasheet measured on one H200 "
             "(HBM_EFFICIENCY 0.896) on every preset vs the datasheet bandwidth", base,
             figures(), (), every_source=True)
    with presets_as([n for n in every if n != "H200 SXM"], lambda hw: {"memory_efficiency": 1}):
        show("HBM_EFFICIENCY on every preset vs on the H200 SXM alone (no scored row ran on "
             "an H200)", base, figures(), (), every_source=True)
    for rate, what, kept in (
            (hardware.HOPPER_NODE_MSMF, "mamf-finder's later node MSMF (a one-wave, short-K "
             "shape at 1850+ MHz)", "kept before round fifteen"),
            (hardware.HOPPER_HELD, "one H200 alone at its 700 W cap, back-to-back 8192^3 "
             "GEMMs held 8 s", "not kept"),
            (hardware.HOPPER_MIX, "one H200 alone at its 700 W cap, a training mix held 24 s, "
             "at its clock", "not kept")):
        for names in (("H100 SXM", "H200 SXM"), ("H100 SXM", "H200 SXM", "H100 96GB (500 W)")):
            with presets_as(names, lambda hw, r=rate: {"sustained": hw.sustained * r
                                                       / hardware.HOPPER_MSMF}):
                show(f"{', '.join(names)}: sustained at mamf-finder's MSMF with 8 H200s "
                     f"computing ({hardware.HOPPER_MSMF} of 794.5) vs {rate} TFLOP/s, "
                     f"{what} ({kept})", base, figures(),
                     (published.DGXC, published.FOUNDRY, published.LLAMA3), every_source=True)
    with patched(attention_rates, "measured", lambda arch: False):
        show("flash attention on Hopper at its kernel's measured rate for the call's rows of "
             "work (attention_rates, one H200) vs the preset's one rate "
             "(attention_efficiency 0.35)", base, figures(), (), every_source=True)
    te = ("megatron-lm", "megatron-bridge")
    with stack_as(te[0], attention_kernel="fa2"), stack_as(te[1], attention_kernel="fa2"):
        show("Transformer Engine stacks on Hopper: cuDNN's fused attention vs "
             "FlashAttention-2", base, figures(), (), every_source=True)
    titans = ("torchtitan", "torchtitan+compile")
    with stack_as(titans[0], attention_kernel="cudnn"), stack_as(titans[1],
                                                                 attention_kernel="cudnn"):
        show("torchtitan on Hopper: SDPA's FlashAttention-2 vs cuDNN's fused attention", base,
             figures(), (), every_source=True)
    titan_both = (titan_h100, published.TITAN)
    with stack_as(titans[0], optimizer=""), stack_as(titans[1], optimizer=""):
        show("torchtitan's optimizer: torch.optim.AdamW foreach (8 passes, 80 bytes, and "
             "clipping's 12) vs the step its kernels name (eager 4, compile Megatron's 14)",
             base, figures(), titan_both, every_source=True)
    with stack_as(titans[0], gather_copy=False), stack_as(titans[1], gather_copy=False):
        show("torchtitan's FSDP2: each all-gather copied out on the compute stream vs not "
             "priced", base, figures(), titan_both, every_source=True)
    with stack_as(titans[0], optimizer="", gather_copy=False), stack_as(
            titans[1], optimizer="", gather_copy=False):
        show("round fourteen's torchtitan re-read, both terms vs neither", base, figures(),
             titan_both, every_source=True)
    with runs_as(lambda r: r | {"hardware": "H100 SXM"} if r["hardware"] ==
                 "H100 96GB (500 W)" else r):
        show("torchtitan's H100s as the 500 W preset vs the 700 W H100 SXM", base,
             figures(), (titan_h100, published.TITAN))
    with runs_as(lambda r: {k: v for k, v in r.items() if k != "expandable_segments"}):
        show("Megatron-Bridge's GB200 405B FP8 rows with the expandable segments their "
             "recipe sets (no fragmentation slack in what must fit) vs the 10% slack",
             base, figures(), (published.BRIDGE,), every_source=True)
    with runs_as(lambda r: r | {"assumed": r["assumed"] + ("recompute none",), "tried": {}}
                 if r["source"] == published.LLAMA3 and r["cp"] == 1 else r):
        show("Llama 3's 8K rows as its section 3.3.2 reads them (no recomputation, an "
             "interleaved schedule) vs both unprinted (the fastest setting that fits)", base,
             figures(), (published.LLAMA3,), every_source=True)
    with runs_as(lambda r: r | {"sharding": "zero1"} if r["source"] == published.LLAMA3
                 else r):
        show("Llama 3's gradients reduce-scattered every micro-batch (ZeRO-2, 'shards "
             "optimizer states and gradients') vs once per step, whole gradients kept (as "
             "torch.distributed.pipelining runs FSDP under PP)", base, figures(),
             (published.LLAMA3,), every_source=True)
    with runs_as(lambda r: r | {"excluded": ""}):
        show("goal set without the exclusion rule (every row in)", base, figures(),
             (published.NARAYANAN,))


if __name__ == "__main__":
    main()
