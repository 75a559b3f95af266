"""Tensor-parallel plans as data, in the style of torchtitan's `parallelize.py`.

A plan is a plain dict {module path: ParallelStyle} for `parallelize_module`; keys may use
fnmatch wildcards per path token ("layers.*.attention.wq"). `apply_plan` checks the plan
against the model and the mesh first, because `parallelize_module` only warns on a key that
matches nothing and skips it, and shards an indivisible dimension unevenly without a word.
`describe_plan` turns a plan into rows for a table, from each style's declared contract
(`tplab.style_specs`).
"""

from __future__ import annotations

import functools

import torch.nn as nn
from tabulate import tabulate
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tplab import plan_check, style_specs
from tplab.core import placements
from tplab.hf import HF_SUPPORTED, from_hf  # noqa: F401 (plans.from_hf: transformers' plans)
from tplab.mesh import tp_mesh

# the checks live in plan_check; plans.check_plan, .check_vocab, .match stay where users look
from tplab.plan_check import check_plan, check_vocab, match, padded_vocab  # noqa: F401

# --- the named plans ---------------------------------------------------------------------


def _sequence_parallel(plan: dict) -> dict:
    """A plan of column- then row-parallel layers, made sequence parallel: each
    column-parallel layer all-gathers its sequence-sharded (Shard(1)) input, each
    row-parallel one reduce-scatters its output back to sequence shards."""
    return {key: ColwiseParallel(input_layouts=Shard(1)) if isinstance(style, ColwiseParallel)
            else RowwiseParallel(output_layouts=Shard(1)) for key, style in plan.items()}


def _standalone(local_input: bool) -> dict:
    """The whole sequence in and out of a lone module under sequence parallelism: shard it
    at the input, gather it at the output."""
    return {"": PrepareModuleInputOutput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_input=local_input,
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)}


def mlp(sequence_parallel: bool = False) -> dict:
    """Megatron's MLP: w1 column-wise (its output stays sharded), w2 row-wise (summed).
    With sequence parallelism (a lone MLP): the input sharded on the sequence, w1
    all-gathers it, w2 reduce-scatters, and the output is gathered whole again."""
    plan = {
        "w1": ColwiseParallel(),
        "w2": RowwiseParallel(),
    }
    if not sequence_parallel:
        return plan
    # the input stays a DTensor (use_local_input=False): each colwise layer gathers it
    return _standalone(False) | _sequence_parallel(plan)


def attention(sequence_parallel: bool = False, prefix: str = "") -> dict:
    """Heads split across ranks: q, k, v column-wise, the output projection row-wise.
    `prefix` ("attention.") names the module inside a block. With sequence parallelism (a
    lone attention): as `mlp(sequence_parallel=True)`; attention reads the sequence length
    from x.shape, which stays the global one on a DTensor input."""
    plan = {
        f"{prefix}wq": ColwiseParallel(),
        f"{prefix}wk": ColwiseParallel(),
        f"{prefix}wv": ColwiseParallel(),
        f"{prefix}wo": RowwiseParallel(),
    }
    if not sequence_parallel or prefix:
        return plan
    return _standalone(False) | _sequence_parallel(plan)


def feed_forward(prefix: str = "") -> dict:
    """Llama's SwiGLU feed-forward: w1 and w3 column-wise, w2 row-wise."""
    return {f"{prefix}w1": ColwiseParallel(), f"{prefix}w3": ColwiseParallel(),
            f"{prefix}w2": RowwiseParallel()}


def block(sequence_parallel: bool = False, *, standalone: bool = True) -> dict:
    """A transformer block: `attention()` and `feed_forward()` under their module names.
    With sequence parallelism the norms and residuals run on sequence shards (Shard(1)):
    all-gather entering attention and feed-forward, reduce-scatter leaving.
    `standalone` adds the shard/unshard of the block's own input and output.
    """
    inner = attention(prefix="attention.") | feed_forward(prefix="feed_forward.")
    if not sequence_parallel:
        return inner
    gather = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    plan = {"attention_norm": SequenceParallel(), "attention": gather}
    plan |= {k: RowwiseParallel(output_layouts=Shard(1)) if isinstance(s, RowwiseParallel)
             else s for k, s in inner.items() if k.startswith("attention.")}
    plan |= {"ffn_norm": SequenceParallel(),
             "feed_forward": PrepareModuleInput(input_layouts=Shard(1),
                                                desired_input_layouts=Replicate())}
    plan |= {k: RowwiseParallel(output_layouts=Shard(1)) if isinstance(s, RowwiseParallel)
             else s for k, s in inner.items() if k.startswith("feed_forward.")}
    return _standalone(True) | plan if standalone else plan


def lm(sequence_parallel: bool = False, loss_parallel: bool = True) -> dict:
    """TinyLM: a vocab-parallel embedding (RowwiseParallel shards its rows), every block,
    and an lm head whose logits stay sharded on the vocab for `loss_parallel()`.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)}
    for key, style in block(sequence_parallel, standalone=False).items():
        plan[f"layers.*.{key}"] = style
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    plan["output"] = ColwiseParallel(input_layouts=seq,
                                     output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)
    return plan


# --- applying and checking ---------------------------------------------------------------


def apply_plan(model: nn.Module, mesh, plan: dict, example_input=None, *,
               checked: str = "") -> nn.Module:
    """`parallelize_module(model, mesh["tp"], plan)` after `check_plan`; returns the model.
    The layouts are checked with `example_input` if given, else at the model's first call
    (before the parallel forward runs). `checked`: what a check already did in the notebook
    (`parallelizer`): "plan" (check_plan, no example input: the layouts are still checked
    at the first call) or "layouts" (both), not done again on every rank."""
    mesh = tp_mesh(mesh)
    if not checked:
        check_plan(model, plan, mesh.size(), example_input)
    if example_input is None and checked != "layouts":
        plan_check.check_at_first_call(model, plan)
    return parallelize_module(model, mesh, plan)


def parallelizer(plan, model: nn.Module | None = None, tp: int | None = None,
                 example_input=None):
    """The `(model, mesh) -> model` function for `plan`, checked first: a dict gives
    `apply_plan` with it, a function is itself. PlanError (one line) for anything else:
    None, a string, a list of pairs, a style class where a style belongs
    (ColwiseParallel, not ColwiseParallel()), a style name as a value.

    Given the (unparallelised) `model` and `tp`, the plan is also checked against it here,
    before anything reaches the ranks: a dict by `check_plan` (with `example_input`, its
    layouts too), a function that states its own check as a `check_plan(model, tp)`
    attribute (`hf.apply_transformers_plan`: its heads) by that."""
    plan_check.check_plan_type(plan)
    if model is not None and isinstance(plan, dict):
        check_plan(model, plan, tp, example_input)
    elif model is not None:
        own = getattr(getattr(plan, "func", plan), "check_plan", None)  # a partial's too
        if callable(own):
            own(model, plan_check.check_tp(tp, "the plan's check"))
    if isinstance(plan, dict):
        # checked here once: the ranks apply it without checking again
        done = "" if model is None else "plan" if example_input is None else "layouts"
        return functools.partial(apply_plan, plan=plan, checked=done)
    return plan


# --- describing --------------------------------------------------------------------------


def _fmt(layouts) -> str:
    if not layouts:
        return "-"
    return ", ".join(placements.name(p) if p is not None else "-" for p in layouts)


def _arrow(handovers) -> str:
    """"A -> B" for the layouts a hook reads and hands on, "A" where they are the same,
    "(local)" where a plain tensor is handed on."""
    if handovers is None:
        return "-"
    handovers = [h for h in handovers if isinstance(h.index, int)]  # positional ones
    before = [h.read for h in handovers]
    after = [h.after for h in handovers]
    if all(p is None for p in before):  # made by the module: only what is handed on
        text = _fmt(after)
    elif before == after or all(p is None for p in after):
        text = _fmt(before)
    else:
        text = f"{_fmt(before)} -> {_fmt(after)}"
    return f"{text} (local)" if any(h.local for h in handovers) else text


def _describe(style, module: nn.Module) -> tuple[dict, str, str]:
    """(parameter placements, inputs, outputs) that the style's spec gives the module."""
    spec = style_specs.spec_of(style, module)
    if spec is None:
        return {}, style_specs.no_spec(style), "-"
    params = {name: placements.name(p) for name, p in spec.params.items()}
    return params, _arrow(spec.inputs) if spec.inputs else "-", _arrow(spec.outputs)


class PlanTable(list):
    """describe_plan's rows; a table in Jupyter and in print()."""

    columns = ("module", "style", "parameters", "inputs", "outputs")

    def _cells(self):
        for row in self:
            params = ", ".join(f"{k}: {v}" for k, v in row["parameters"].items()) or "-"
            yield [row["module"], row["style"], params, row["inputs"], row["outputs"]]

    def __str__(self) -> str:
        return tabulate(list(self._cells()), headers=self.columns)

    def _repr_html_(self) -> str:
        return tabulate(list(self._cells()), headers=self.columns, tablefmt="html")


def describe_plan(model: nn.Module, plan: dict) -> PlanTable:
    """One row per (plan key, matched module): module, style, parameter placements, and the
    input and output layouts ("A -> B" where the style redistributes; "(local)" where the
    module hands on a plain tensor), read from each style's `tplab.style_specs.StyleSpec`;
    a style that declares none says so in its row. Works on the unparallelised model, on
    either side."""
    rows = PlanTable()
    for key, style in plan.items():
        for path, module in match(model, key) or [(key, None)]:
            if module is None:
                rows.append({"module": path, "style": type(style).__name__, "parameters": {},
                             "inputs": "no such module", "outputs": "-"})
                continue
            params, inputs, outputs = _describe(style, module)
            rows.append({"module": path or "(root)", "style": type(style).__name__,
                         "parameters": params, "inputs": inputs, "outputs": outputs})
    return rows
