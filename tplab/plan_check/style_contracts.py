"""What each ParallelStyle reads and hands on: its layout contract, for `tplab.plan_check`.

Read from torch's own definitions (torch/distributed/tensor/parallel/style.py):
ColwiseParallel / RowwiseParallel / SequenceParallel read a plain input as `input_layouts`
(`sequence_sharding`) and hand on `output_layouts`, as a plain tensor when
`use_local_output`; a DTensor input is redistributed, so it always fits.
PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput do the same per
argument. Another style may state its own with a `layout_contract(module)` method (`known`);
the rest (transformers', subclasses) are not known, and nothing in or below them is
checked.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

KNOWN_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
                PrepareModuleOutput, PrepareModuleInputOutput)


def known(style) -> bool:
    """Whether this check knows what `style` reads and hands on: torch's six styles (their
    exact classes: a subclass may change the hooks), or a style that says so itself (for
    tplab's own styles) with `layout_contract(module) -> (inputs, kwarg_inputs, outputs)`:
    inputs [(arg index, layout it reads a plain tensor as, layout after, plain after)],
    kwarg_inputs {name: (read, after, plain after)}, outputs [(layout read or None, layout
    handed on, plain)] per output, or None where it leaves the outputs alone."""
    return type(style) in KNOWN_STYLES or callable(getattr(style, "layout_contract", None))


def _one(layouts):
    return layouts[0] if isinstance(layouts, tuple) else layouts



def inputs_of(style, module) -> tuple[list, dict]:
    """([(arg index, layout read, layout after, local after)], {kwarg: ...}) of a style's
    input hook; layouts None where the style leaves an input alone."""
    if type(style) not in KNOWN_STYLES:
        args, kwargs, _ = style.layout_contract(module)
        return list(args), dict(kwargs)
    if type(style) in (ColwiseParallel, RowwiseParallel):
        if type(style) is RowwiseParallel:  # set by RowwiseParallel._apply, per module
            desired = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        else:
            desired = _one(style.desired_input_layouts)
        return [(0, _one(style.input_layouts), desired, False)], {}
    if type(style) is SequenceParallel:
        seq = _one(style.sequence_sharding)
        return [(0, seq, seq, False)], {}
    if type(style) is PrepareModuleInputOutput:
        style = style.prepare_module_input
    if type(style) is PrepareModuleInput:
        # no desired layout: the input keeps the one it was read as
        args = [(i, lay, want or lay, style.use_local_output) for i, (lay, want) in enumerate(
            zip(style.input_layouts or (), style.desired_input_layouts or (), strict=False))
            if lay is not None]
        kws = {k: (lay, style.desired_input_kwarg_layouts.get(k) or lay, style.use_local_output)
               for k, lay in (style.input_kwarg_layouts or {}).items() if lay is not None}
        return args, kws
    return [], {}


def outputs_of(style, module) -> list | None:
    """[(layout read, layout handed on, local)] per output of a style's output hook; None
    where the style leaves the outputs alone."""
    if type(style) not in KNOWN_STYLES:
        return style.layout_contract(module)[2]
    if type(style) in (ColwiseParallel, RowwiseParallel):
        out = _one(style.output_layouts)
        return [(None, out, style.use_local_output)]
    if type(style) is SequenceParallel:
        return [(None, _one(style.sequence_sharding), style.use_local_output)]
    if type(style) is PrepareModuleInputOutput:
        style = style.prepare_module_output
    if type(style) is PrepareModuleOutput:
        return [(lay, want or lay, style.use_local_output) for lay, want in
                zip(style.output_layouts, style.desired_output_layouts, strict=False)]
    return None
