"""The exercises: what each asks, its graded hints, and the checker that judges an answer.

Order follows the curriculum: the conjugate operators (notebook 01), parallel linears (03),
sequence parallelism (05), DTensor plans (03, 05), counting collectives and costing them (08).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field

import tplab
from tplab import models
from tplab.cost.collectives import collective_terms, collective_time
from tplab.cost.hardware import HARDWARE
from tplab.cost.lab_models import lab_memory
from tplab.exercises import checks, fsdp_placements, qk_norm
from tplab.exercises.feedback import fail, fmt_counts
from tplab.exercises.training_check import check_clip


@dataclass(frozen=True)
class Exercise:
    name: str
    title: str
    task: str
    hints: tuple[str, ...]
    checker: object = field(repr=False)
    notebook: str = ""
    needs_lab: bool = True
    # On fewer ranks nothing is split and no collective moves data: a wrong f, g, plan or
    # prediction computes what a right one does, so the check could not tell them apart.
    min_world_size: int = 2


def _number(name: str, answer: dict, key: str, what: str) -> float:
    """answer[key] as a float, or the feedback that says why it is not a number."""
    value = answer[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(name, f'"{key}" must be a number ({what}), not {type(value).__name__} '
                         f"{value!r}")
    if not math.isfinite(value) or value < 0:
        raise fail(name, f'"{key}" must be a finite number >= 0 ({what}), not {value!r}')
    return float(value)


def _counts(name: str, answer, phase: str) -> dict:
    """answer[phase] as {op: count}, or the feedback that says what is wrong with it."""
    said = answer.get(phase, {})
    example = '{"all_reduce": 2}'
    if not isinstance(said, dict):
        raise fail(name, f'"{phase}" must be a dict {{op: count}} such as {example}, not '
                         f"{type(said).__name__} {said!r}")
    counts = {}
    for op, n in said.items():
        if not isinstance(op, str):
            raise fail(name, f'in "{phase}", {op!r} is not a collective\'s name (a string '
                             'such as "all_reduce")')
        if isinstance(n, float) and n.is_integer():
            n = int(n)   # 2.0 is the whole number 2
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise fail(name, f'in "{phase}", the count of {op!r} must be a whole number '
                             f">= 0, not {type(n).__name__} {n!r}")
        counts[op] = int(n)
    return {op: n for op, n in counts.items() if n}


def _predict_counts(name, answer, lab):
    if not (isinstance(answer, dict) and set(answer) <= {"forward", "backward"}):
        raise fail(name, 'the answer is a dict {"forward": {op: count}, "backward": {op: count}}'
                         f", not {answer!r}")
    said_by_phase = {phase: _counts(name, answer, phase) for phase in ("forward", "backward")}
    cfg = checks.exercise_config(lab)
    build = functools.partial(models.Block, cfg)
    make_x = functools.partial(models.make_input, cfg)
    traced = checks.reference_counts(name, lab, build, tplab.plans.block(), make_x,
                                     ("tplab.plans.block()", repr(cfg)))
    for phase in ("forward", "backward"):
        said = said_by_phase[phase]
        real = traced["counts"].get(phase, {})
        if said != real:
            where = [m or "(block)" for ph, _, m in traced["records"] if ph == phase]
            raise fail(name, f"{phase}: you predicted {fmt_counts(said)}, the ranks issued "
                             f"{fmt_counts(real)} (in {', '.join(where) or 'no module'})"
                             + ("; each ColwiseParallel layer's input is its own f, so the "
                                "backward sums dL/dx once per colwise layer"
                                if phase == "backward" else ""))
    return f"right: {traced['counts']} on a {lab.world_size}-rank tp group"


def _predict_memory(name, answer, lab=None):
    """Activation bytes of one Block at TP 4 with SP: tplab.cost's model, which equals what
    tplab.memory measures on the ranks byte for byte (tests/test_memory.py)."""
    if not (isinstance(answer, dict) and "activation_bytes" in answer):
        raise fail(name, f'the answer is a dict {{"activation_bytes": ...}}, not {answer!r}')
    cfg = models.Config()
    want = lab_memory("block", cfg, 4, sequence_parallel=True)
    said = _number(name, answer, "activation_bytes", "the bytes each rank saves")
    if said == want["activation_bytes"]:
        return f"right: {int(said):,} bytes saved for backward on each of the 4 ranks"
    known = {lab_memory("block", cfg, 4)["activation_bytes"]:
             "that is TP without SP: the norms' inputs and the regions' inputs stay whole on "
             "every rank; SP splits them by the sequence",
             lab_memory("block", cfg, 1)["activation_bytes"]:
             "that is one rank holding the whole block: divide what TP shards by 4"}
    rows = ", ".join(f"{r['module'] or '(block)'} {r['bytes']:,}" for r in want["rows"])
    hint = known.get(said, f"per module the model counts {rows}")
    raise fail(name, f"activation bytes: you said {said:,.0f}, each rank saves "
                     f"{want['activation_bytes']:,} ({said / want['activation_bytes']:.2f}x "
                     f"yours): {hint}")


def _predict_cost(name, answer, lab=None):
    if not (isinstance(answer, dict) and {"bytes", "seconds"} <= set(answer)):
        lacks = [repr(k) for k in ("bytes", "seconds") if isinstance(answer, dict)
                 and k not in answer]
        missing = f" (it lacks {', '.join(lacks)})" if lacks else ""
        raise fail(name, f'the answer is a dict {{"bytes": ..., "seconds": ...}}, not {answer!r}'
                         + missing)
    nbytes, n, hw = 1 * 4096 * 8192 * 2, 8, HARDWARE["H100 SXM"]
    sent = 2 * (n - 1) / n * nbytes
    seconds = collective_time("all_reduce", nbytes, n, hw)
    b = _number(name, answer, "bytes", "the bytes each GPU sends")
    if not math.isclose(b, sent, rel_tol=0.01):
        ratio = b / sent if sent else float("inf")
        why = {0.5: "that is one pass: an all-reduce is a reduce-scatter and then an "
                    "all-gather, each sending (n-1)/n of the tensor",
               n / (n - 1) / 2: "that is the whole tensor: a ring sends 2 (n-1)/n of it",
               n / (n - 1): "that is twice the tensor: a ring sends 2 (n-1)/n of it, not 2"}
        hint = next((v for k, v in why.items() if math.isclose(ratio, k, rel_tol=0.02)),
                    "each GPU sends 2 (n-1)/n x the tensor's bytes in a ring all-reduce")
        raise fail(name, f"bytes: you said {b:,.0f}, each GPU sends {sent:,.0f} "
                         f"(yours is {ratio:.2f}x that): {hint}")
    s = _number(name, answer, "seconds", "the all-reduce's time in seconds")
    if not math.isclose(s, seconds, rel_tol=0.05):
        latency, transfer = collective_terms("all_reduce", nbytes, n, hw)
        raise fail(name, f"seconds: you said {s * 1e6:.1f} us, the model says "
                         f"{seconds * 1e6:.1f} us = {latency * 1e6:.1f} us of latency "
                         f"({hw.intra.base_latency * 1e6:.1f} us per call + 2 (n-1) steps x "
                         f"{hw.intra.latency * 1e6:.1f} us) + {transfer * 1e6:.1f} us of bytes "
                         f"at {hw.intra.bandwidth / 1e9:.0f} GB/s (NVLink 4's bus bandwidth, "
                         "as nccl-tests measures it)")
    return f"right: {sent / 2**20:.1f} MiB sent per GPU, {seconds * 1e6:.1f} us"


_F_HINTS = ("f sits where an unsplit x enters a split layer. Which of forward and backward "
            "needs to talk to the other ranks?",
            "Forward: every rank already has x, so return x.view_as(x). Backward: each rank "
            "holds one term of dL/dx; the true gradient is their sum.",
            "backward: grad = grad.clone(); dist.all_reduce(grad, group=ctx.group); return "
            "grad, None. Keep the group with ctx.group = group in forward.")

EXERCISES = [
    Exercise("f", "Write f: identity forward, all-reduce backward",
             "class Answer(torch.autograd.Function) with forward(ctx, x, group) and "
             "backward(ctx, grad); called as Answer.apply(x, group).",
             _F_HINTS, checks.check_f, "01"),
    Exercise("g", "Write g: all-reduce forward, identity backward",
             "class Answer(torch.autograd.Function): x is this rank's partial sum; "
             "Answer.apply(x, group) returns the sum over the ranks.",
             ("g is f's conjugate: swap what forward and backward do.",
              "Forward: sum the partials. Since y = sum_r x_r, dL/dx_r = dL/dy: what does "
              "that make the backward?",
              "forward: y = x.clone(); dist.all_reduce(y, group=group); return y. backward: "
              "return grad, None."), checks.check_g, "01"),
    Exercise("column_parallel", "A column-parallel linear",
             "class Answer(nn.Module): __init__(self, linear, mesh) keeps this rank's rows of "
             "linear.weight (out, in) and bias as self.weight, self.bias; forward(x) returns "
             "this rank's out/N output features. mesh.get_group(), mesh.size(), "
             "mesh.get_local_rank().",
             ("Y = X A^T: split the output features. Which rows of weight (out, in) give rank "
              "r's features?",
              "Rows [r*out/N, (r+1)*out/N). x is whole on every rank, so its gradient is a "
              "sum over ranks: it needs f.",
              "forward: x = F_.apply(x, group) (your f), then F.linear(x, self.weight, "
              "self.bias)."), checks.check_column, "03"),
    Exercise("row_parallel", "A row-parallel linear",
             "class Answer(nn.Module): __init__(self, linear, mesh) keeps this rank's columns "
             "of linear.weight as self.weight and the whole bias as self.bias; forward(x_r) "
             "takes this rank's in/N input features and returns the whole y on every rank.",
             ("Each rank multiplies its features by its columns of weight: a partial sum.",
              "Sum the partials with g. How many times may the bias be added?",
              "forward: partial = F.linear(x_r, self.weight); return G.apply(partial, group) + "
              "self.bias."), checks.check_row, "03"),
    Exercise("sp_pair", "The sequence-parallel pair",
             "A tuple (GatherSeq, ReduceScatterSeq) of autograd Functions, each called as "
             ".apply(x, group), on dim 1 (the sequence): GatherSeq all-gathers a (b, s/N, d) "
             "shard to (b, s, d); ReduceScatterSeq sums partial (b, s, d) tensors and keeps "
             "this rank's (b, s/N, d).",
             ("Under SP, f becomes an all-gather and g a reduce-scatter. What is each one's "
              "backward?",
              "The conjugate of an all-gather is a reduce-scatter, and the reverse.",
              "dist.all_gather_single and dist.reduce_scatter_single (before torch 2.13: "
              "all_gather_into_tensor, reduce_scatter_tensor) work on dim 0: "
              "x.movedim(1, 0).contiguous() first, .movedim(0, 1) after."),
             checks.check_sp_pair, "05"),
    Exercise("mlp_plan", "A DTensor plan for the MLP",
             'A dict {module path: ParallelStyle} for tplab.models.MLP (w1, then GELU, then '
             "w2) that costs one all-reduce forward and one backward.",
             ("Megatron splits w1 by its outputs and w2 by its inputs.",
              "ColwiseParallel keeps its output sharded; RowwiseParallel takes a sharded input "
              "and sums.",
              '{"w1": ColwiseParallel(), "w2": RowwiseParallel()}'),
             checks.check_mlp_plan, "03"),
    Exercise("block_sp_plan", "A plan for the block, with sequence parallelism",
             "A dict for tplab.models.Block that takes and returns whole sequences, and inside "
             "runs attention_norm and ffn_norm on sequence shards (Shard(1)).",
             ("Start from plans.block(): which layers become all-gathers and reduce-scatters?",
              'The block\'s own input goes Replicate -> Shard(1) (PrepareModuleInputOutput on '
              '""); the norms get SequenceParallel(); attention and feed_forward take Shard(1) '
              "and want Replicate (PrepareModuleInput).",
              "The rowwise layers end in Shard(1): RowwiseParallel(output_layouts=Shard(1))."),
             checks.check_block_plan, "05"),
    Exercise("fix_plan", "Fix a broken plan",
             "exercises.broken_plan() is a sequence-parallel plan for the Block that runs, "
             "and gives the right output, but wrong gradients. Find the bug; answer the fixed "
             "plan.",
             ("Run tplab.grad_check with it: which rows fail?",
              "The failing parameters belong to modules the plan does not mention. On which "
              "part of the sequence do they run?",
              "The norms run on sequence shards, so their gradients are partial: give them "
              "SequenceParallel()."), checks.check_block_plan, "05"),
    Exercise("block_counts", "Predict a block's collectives",
             'For tplab.models.Block under tplab.plans.block() (no SP) on the lab\'s ranks: '
             '{"forward": {op: count}, "backward": {op: count}}, checked against a trace.',
             ("Forward: where do partial sums get added up?",
              "Backward: every ColwiseParallel layer takes a Replicate input, whose gradient "
              "is a sum over ranks. How many colwise layers are there?",
              "wo and w2 each end in an all-reduce forward; wq, wk, wv, w1 and w3 each cost "
              "one all-reduce backward."), _predict_counts, "08"),
    Exercise("cost_prediction", "Predict bytes and time with the cost model",
             "A ring all-reduce of a (1, 4096, 8192) bf16 activation over the 8 GPUs of one "
             'H100 SXM node: {"bytes": bytes each GPU sends, "seconds": its time}.',
             ("A ring all-reduce is a reduce-scatter then an all-gather.",
              "Each half sends (n-1)/n of the tensor, in n-1 steps of alpha each.",
              "bytes = 2 (n-1)/n * 4096*8192*2; seconds = 8.4e-6 + 2 (n-1) * 1.9e-6 "
              "+ bytes / 370e9."),
             _predict_cost, "08", needs_lab=False),
    Exercise("block_memory", "Predict a block's activation memory at TP 4 with SP",
             "tplab.models.Block with tplab.models.Config() (float32) under plans.block("
             "sequence_parallel=True) on 4 ranks: the bytes each rank saves for backward in "
             'one step, as tplab.memory counts them: {"activation_bytes": N}.',
             ("tokens = batch_size x seq_len; under SP a rank keeps 1/4 of the sequence "
              "outside the TP regions, and 1/4 of the heads and hidden units inside.",
              "Count what each op saves: a linear its input, RMSNorm its input and fp32 "
              "statistics, attention q, k, v, its output and a logsumexp, SwiGLU its inputs.",
              "tplab.cost.lab_models.lab_memory('block', cfg, 4, sequence_parallel=True) "
              "lists every saved tensor; notebook 10 derives them."),
             _predict_memory, "10", needs_lab=False),
    Exercise("clip_grad", "Clip gradients under tensor parallelism",
             "A function clip(model, max_norm) -> total norm for a model split by "
             "tplab.megatron.parallelize, whose parameters are plain local shards (each "
             "layer's tp_placements says which): scale every gradient by min(1, max_norm / "
             "norm), with the norm of the WHOLE model's gradient. Checked with "
             "tplab.train_check over clipped SGD steps.",
             ("torch.nn.utils.clip_grad_norm_ sees only this rank's pieces. Is its norm the "
              "whole model's?",
              "Square norms add up: sum the sharded gradients' squares over the tp group "
              "(dist.all_reduce). The replicated ones are the same on every rank: how often "
              "may they count?",
              "square = sum of g.pow(2).sum() over the Shard gradients; all_reduce(square, "
              "group); add the replicated squares once; total = sqrt; multiply every grad "
              "by clamp(max_norm / (total + 1e-6), max=1)."), check_clip, "12"),
]
EXERCISES.append(Exercise("qk_norm_grad", qk_norm.TITLE, qk_norm.TASK, qk_norm.HINTS,
                          qk_norm.check_qk_norm_grad, "11"))

EXERCISES.append(Exercise("fsdp_placements", fsdp_placements.TITLE, fsdp_placements.TASK,
                          fsdp_placements.HINTS, fsdp_placements.check_fsdp_placements, "13",
                          needs_lab=False))

BY_NAME = {e.name: e for e in EXERCISES}
