"""What a parallel style does, declared once: a `StyleSpec` per style and module.

A `ParallelStyle` (torch.distributed.tensor.parallel.style) is code: `_apply(module, mesh)`
installs hooks. What those hooks do is the style's contract, and every tool of the lab needs
it: `plans.describe_plan` prints it, `plan_check` checks a plan against it (the modules it
splits, what tp must divide, how it reads and hands on activations) and the trace's causes
quote its reasons. So each style declares it in one place, after torchtitan's
`ShardingConfig` (protocols/sharding.py: state shardings, input and output layouts):

- tplab's own styles (tplab.parallel_styles) and any style of one's own: a method
  `spec(module, tp=None) -> StyleSpec` on the class (tp: the tensor-parallel size when
  known, for reasons that name each rank's rows);
- torch's six styles: `TORCH_SPECS` below, read from torch's own definitions
  (torch/distributed/tensor/parallel/style.py).

`spec_of(style, module)` finds either; None for a style that declares none (a user's own
ParallelStyle subclass): the tools then say so (`NO_SPEC`) and check nothing in or below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from tplab.core import placements
from tplab.errors import PlanError

__all__ = ["NO_SPEC", "TORCH_SPECS", "Collective", "Handover", "StyleSpec",
           "no_spec", "spec_of"]

NO_SPEC = "declares no StyleSpec"


@dataclasses.dataclass(frozen=True)
class Handover:
    """One tensor a style's hook takes (an input) or hands on (an output).

    `read`: the layout the hook takes a plain tensor as (an input's `input_layouts`; for an
    output, what the module computes, e.g. Partial(sum) after a row-wise layer); None where
    the hook leaves it alone. `after`: the layout it has once the hook is done (None: as it
    came). `local`: handed on as a plain tensor (`use_local_output`), not a DTensor.
    `index`: the positional argument (an int) or keyword argument (a str) of an input, the
    position of an output. `believed`: the hook takes a plain tensor to be `read` (as
    `DTensor.from_local` does, so the plan check compares); False where it gets a DTensor,
    whose own placements say what it is (a Colwise's output)."""

    read: Placement | None
    after: Placement | None
    local: bool = False
    index: int | str = 0
    believed: bool = True


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective a style issues in one pass, and why (the trace shows `why` as its
    cause). `op`: "all_reduce", "all_gather", "reduce_scatter", ... as trace records name
    them."""

    op: str
    why: str


@dataclasses.dataclass(frozen=True)
class StyleSpec:
    """A style's contract on one module.

    `params`: {parameter name: placement it gives}. `inputs`: the Handovers of its input
    hook; `outputs`: those of its output hook, None where it leaves the outputs alone.
    `modules`: the module classes it can split (empty: any). `divides`: (what, length)
    pairs that tp must divide. `heads`: it splits an attention module's heads (a
    column-parallel projection). `forward`, `backward`: the collective each pass issues.
    `layouts_known`: the plan check follows activations through it (False: the style's
    effect on them is not one `inputs`/`outputs` can state; nothing in or below it is
    checked, never a guess)."""

    params: dict[str, Placement] = dataclasses.field(default_factory=dict)
    inputs: tuple[Handover, ...] = ()
    outputs: tuple[Handover, ...] | None = None
    modules: tuple[type, ...] = ()
    divides: tuple[tuple[str, int], ...] = ()
    heads: bool = False
    forward: tuple[Collective, ...] = ()
    backward: tuple[Collective, ...] = ()
    layouts_known: bool = True


def _one(layouts):
    return layouts[0] if isinstance(layouts, tuple) else layouts


def _local_params(module: nn.Module, layout: Placement) -> dict[str, Placement]:
    return {name: layout for name, _ in module.named_parameters(recurse=False)}


def _linear_spec(style, module: nn.Module, colwise: bool) -> StyleSpec:
    """ColwiseParallel / RowwiseParallel: an nn.Linear's weight split on its output (input)
    features, an nn.Embedding's on its dim (rows)."""
    embedding = isinstance(module, nn.Embedding)
    weight_dim = (1 if embedding else 0) if colwise else (0 if embedding else 1)
    params = {name: Shard(weight_dim) if name == "weight" else
              Shard(0) if colwise else Replicate()
              for name, _ in module.named_parameters(recurse=False)}
    if colwise:
        read, computed = _one(style.input_layouts), Shard(-1)
        desired = _one(style.desired_input_layouts)
    else:  # set by RowwiseParallel._apply, per module
        read, computed = _one(style.input_layouts), Partial()
        desired = Replicate() if embedding else Shard(-1)
    if isinstance(module, nn.Linear):
        divides = [("out_features (weight dim 0)", module.out_features)] if colwise else [
            ("in_features (weight dim 1)", module.in_features)]
    elif embedding:
        divides = [("embedding_dim (weight dim 1)", module.embedding_dim)] if colwise else [
            ("num_embeddings (weight dim 0)", module.num_embeddings)]
    else:
        divides = []
    out = _one(style.output_layouts)
    forward = (_moved(read, desired, "the input"), _moved(computed, out, "the output"))
    if colwise:  # the input's gradient: each rank's columns give a partial sum of it
        backward = (_moved(Partial(), read, "the input's gradient (f)"),)
    else:        # a split's gradient is gathered; a sum's is handed on as it is
        backward = (_moved(out, Replicate(), "the output's gradient"),
                    _moved(desired, read, "the input's gradient"))
    return StyleSpec(
        params=params, inputs=(Handover(read, desired, False),),
        outputs=(Handover(computed, out, style.use_local_output, believed=False),),
        modules=(nn.Linear, nn.Embedding), divides=tuple(divides),
        heads=colwise and isinstance(module, nn.Linear),
        forward=tuple(c for c in forward if c), backward=tuple(c for c in backward if c))


_OPS = {(Shard, Replicate): "all_gather", (Partial, Replicate): "all_reduce",
        (Partial, Shard): "reduce_scatter"}


def _moved(before, after, what: str) -> Collective | None:
    """The collective of DTensor's redistribution of `what` from `before` to `after`
    (None: none, a split or no move)."""
    op = _OPS.get((type(before), type(after))) if before != after else None
    return Collective(op, f"{what}: {placements.name(before)} -> {placements.name(after)}"
                      ) if op else None


def _sequence_spec(style: SequenceParallel, module: nn.Module) -> StyleSpec:
    seq = _one(style.sequence_sharding)
    return StyleSpec(params=_local_params(module, Replicate()),
                     inputs=(Handover(seq, seq, False),),
                     outputs=(Handover(None, seq, style.use_local_output),),
                     backward=(Collective("all_reduce", "the replicated weight's gradient: "
                                          "one partial sum per sequence shard"),))


def _prepare_inputs(style: PrepareModuleInput) -> tuple[Handover, ...]:
    """One Handover per argument (no desired layout: the input keeps the one it was read
    as), then one per keyword argument."""
    local = style.use_local_output
    args = [Handover(lay, want or lay, local, i) for i, (lay, want) in enumerate(
        zip(style.input_layouts or (), style.desired_input_layouts or (), strict=False))]
    kws = [Handover(lay, style.desired_input_kwarg_layouts.get(k) or lay, local, k)
           for k, lay in (style.input_kwarg_layouts or {}).items() if lay is not None]
    return (*args, *kws)


def _prepare_outputs(style: PrepareModuleOutput) -> tuple[Handover, ...]:
    return tuple(Handover(lay, want or lay, style.use_local_output, i) for i, (lay, want) in
                 enumerate(zip(style.output_layouts, style.desired_output_layouts,
                               strict=False)))


def _prepared(handovers, backward: bool, what: str) -> tuple[Collective, ...]:
    """The collectives of a Prepare style's redistributions: forward, each A -> B; backward,
    their conjugates (a split's gradient is gathered; an input gathered whole for a sharded
    module gets partial gradients: reduce-scattered; an output gathered for whole use: split)."""
    found = []
    for h in handovers or ():
        name = f"{what} {h.index}"
        if not backward:
            found.append(_moved(h.read, h.after, name))
        elif isinstance(h.read, Shard) and isinstance(h.after, Replicate) and what == "input":
            found.append(_moved(Partial(), h.read, f"{name}'s gradient"))
        elif isinstance(h.read, (Replicate, Partial)) and isinstance(h.after, Shard):
            found.append(_moved(h.after, Replicate(), f"{name}'s gradient"))
    return tuple(c for c in found if c)


def _prepare_spec(style, module: nn.Module) -> StyleSpec:
    p_in = style if isinstance(style, PrepareModuleInput) else getattr(
        style, "prepare_module_input", None)
    p_out = style if isinstance(style, PrepareModuleOutput) else getattr(
        style, "prepare_module_output", None)
    inputs = _prepare_inputs(p_in) if p_in is not None else ()
    outputs = _prepare_outputs(p_out) if p_out is not None else None
    return StyleSpec(inputs=inputs, outputs=outputs,
                     forward=_prepared(inputs, False, "input") + _prepared(outputs, False,
                                                                           "output"),
                     backward=_prepared(inputs, True, "input") + _prepared(outputs, True,
                                                                           "output"))


# torch's styles: their contract, read from torch/distributed/tensor/parallel/style.py
TORCH_SPECS: dict[type, Callable[..., StyleSpec]] = {
    ColwiseParallel: lambda style, module: _linear_spec(style, module, True),
    RowwiseParallel: lambda style, module: _linear_spec(style, module, False),
    SequenceParallel: _sequence_spec,
    PrepareModuleInput: _prepare_spec,
    PrepareModuleOutput: _prepare_spec,
    PrepareModuleInputOutput: _prepare_spec,
}


def _from_layout_contract(style, module: nn.Module) -> StyleSpec:
    """The older way a style stated its layouts: `layout_contract(module) -> (inputs,
    kwarg_inputs, outputs)` as tuples (arg index, read, after, local)."""
    args, kwargs, outs = style.layout_contract(module)
    inputs = [Handover(read, after, local, i) for i, read, after, local in args]
    inputs += [Handover(read, after, local, k) for k, (read, after, local) in
               dict(kwargs).items()]
    outputs = None if outs is None else tuple(
        Handover(read, after, local, i) for i, (read, after, local) in enumerate(outs))
    return StyleSpec(inputs=tuple(inputs), outputs=outputs)


def spec_of(style, module: nn.Module, tp: int | None = None) -> StyleSpec | None:
    """The StyleSpec `style` declares for `module`: its own `spec(module, tp)` method, or
    TORCH_SPECS for torch's styles (a subclass of one gets its parent's parameters and
    sizes, but its layouts are not followed: it may change the hooks); None when it
    declares none."""
    own = getattr(style, "spec", None)
    if callable(own):
        try:
            return own(module, tp)
        except (AttributeError, TypeError, ValueError) as exc:  # a module it was not made for
            raise PlanError(f"{type(style).__name__}.spec cannot describe a "
                            f"{type(module).__name__}: {type(exc).__name__}: {exc}") from exc
    if callable(getattr(style, "layout_contract", None)):
        return _from_layout_contract(style, module)
    for cls in type(style).__mro__:
        if cls in TORCH_SPECS:
            spec = TORCH_SPECS[cls](style, module)
            return spec if cls is type(style) else dataclasses.replace(spec,
                                                                       layouts_known=False)
    return None


def no_spec(style) -> str:
    """What the tools say of a style without a spec."""
    kind = type(style).__name__
    return (f"{kind} {NO_SPEC}: give it a spec(module, tp=None) method returning "
            "tplab.style_specs.StyleSpec (its placements, layouts, sizes, collectives)")
