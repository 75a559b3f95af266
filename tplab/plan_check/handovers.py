"""Each hand-over between a model's modules, checked as `tplab.plan_check` runs the meta
copy: hooks on every module compare the layout a tensor arrives with (its `layout_flow`
tag) against what the receiving style reads (`layout_contracts`), re-tag what the style
hands on, and raise a PlanError that names both modules, both placements and a fix.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils._pytree import tree_flatten

from tplab.core import placements
from tplab.core.pytrees import map_tensors
from tplab.errors import PlanError
from tplab.plan_check.style_contracts import inputs_of, known, outputs_of
from tplab.plan_check.tags import (
    Flow,
    Tracer,
    layout_name,
    local_description,
    normalized,
    short_name,
)

# styles that only move a module's inputs or outputs: the module computes with whole weights
_MOVE_ONLY = (PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput)


@dataclasses.dataclass(frozen=True)
class Edge:
    """One hand-over the check looked at: `producer` (a planned module, or None for the
    model's input) gives `consumer` a tensor of `layout`; `expected` is how the consumer's
    style reads a plain tensor (None: a DTensor, redistributed as needed)."""

    producer: str | None
    consumer: str
    layout: str
    expected: str | None



def tensors_of(obj):
    """(None, tensor) for each tensor in `obj` (nested containers too)."""
    return [(None, t) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _fix(flow: Flow, consumer: str, style, actual, expected, ndim: int) -> str:
    """A suggestion for a plain `actual` tensor read as `expected` by `consumer`'s style."""
    kind = type(style).__name__
    expected = normalized(expected, ndim)
    src = flow.source or flow.via
    last = Shard(ndim - 1)
    as_input = placements.shard(-1 if actual == last else actual.dim) if type(actual) is Shard \
        else layout_name(actual)
    if actual == last and expected == Replicate() and type(style) is ColwiseParallel:
        tail = f", or give {src} output_layouts=Replicate() (an all-gather)" if src else ""
        return (f"make {consumer} RowwiseParallel() (a row-wise layer takes the Shard(-1) "
                f"activations a column-wise one leaves; Megatron pairs them){tail}")
    if actual == Replicate() and type(style) is RowwiseParallel:
        before = f"make {src} ColwiseParallel() so its output arrives sharded on the last " \
            "dim, or " if src else ""
        return (f"{before}give {consumer} input_layouts=Replicate() (each rank then takes "
                "its own slice of the whole input)")
    return (f"give {consumer}'s {kind} input_layouts={as_input} (it then redistributes to "
            f"the layout it computes on)"
            + (f", or change {src}'s output_layouts to {layout_name(expected)}" if src else ""))


def _mismatch(flow: Flow, consumer: str, style, actual, expected, ndim: int,
              output: bool = False) -> PlanError:
    kind = type(style).__name__
    consumer = consumer or "the model"  # the plan key "": the root module
    got = local_description(dataclasses.replace(flow, layout=actual), ndim)
    if output:  # PrepareModuleOutput reads the module's own output
        return PlanError(
            f"layouts do not chain: {consumer} returns {got} (from {flow.where()}), but its "
            f"{kind} reads it as {layout_name(expected)} (output_layouts). Fix: give {consumer}'s "
            f"{kind} output_layouts={layout_name(actual)}")
    reads = "sequence_sharding" if type(style) is SequenceParallel else "input_layouts"
    return PlanError(
        f"layouts do not chain: {flow.where()} hands {consumer} ({kind}) {got}, but "
        f"{consumer}'s {kind} reads a plain input as {layout_name(expected)} ({reads}); on the "
        f"ranks its shapes would not fit. Fix: "
        f"{_fix(flow, consumer, style, actual, expected, ndim)}")


def _needs_whole(tracer: Tracer, path: str, module: nn.Module, args,
                 planned: str = "not in the plan") -> None:
    """An unplanned module (or one whose styles only move its inputs and outputs) that
    needs whole the dim a local shard splits."""
    x = args[0] if args else None
    flow = tracer.flow(x)
    if flow is None or not flow.local or type(flow.layout) is Replicate:
        return
    kind = type(module).__name__
    weight = getattr(module, "weight", None)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        span = len(module.normalized_shape or ()) or 1
    elif kind.endswith("Norm") and isinstance(weight, torch.Tensor) and weight.ndim == 1 \
            and x.ndim and weight.shape[0] == x.shape[-1]:
        span = 1  # a norm over the last dim (LlamaRMSNorm, Qwen3RMSNorm, ...)
    elif isinstance(module, nn.Linear):
        span, kind = 1, "nn.Linear"
    else:
        return
    partial = type(flow.layout) is Partial
    if not partial and flow.layout.dim < x.ndim - span:
        return  # sharded elsewhere (the sequence, the heads): fine for this module
    what = "normalizes over" if kind != "nn.Linear" else "contracts"
    src = flow.source or flow.via
    fix = (f"plan {path} as RowwiseParallel() (it takes the Shard(-1) input and sums the "
           f"ranks' parts), or give {src} output_layouts=Replicate()" if kind == "nn.Linear"
           else f"give {src} output_layouts=Replicate() (or end the sharded region with a "
           f"RowwiseParallel before {path})")
    raise PlanError(
        f"layouts do not chain: {flow.where()} hands {path} ({kind}, {planned}) "
        f"{local_description(flow, x.ndim)}, but {path} {what} "
        f"{'its last dim' if span == 1 else f'its last {span} dims'} and needs it whole "
        f"on every rank{' (the sums are still pending)' if partial else ''}. Fix: {fix}")


class HandoverHooks:
    """Forward (pre-)hooks on every module of the meta copy: check and re-tag."""

    def __init__(self, tracer: Tracer, planned: dict, edges: list):
        self.tracer, self.planned, self.edges = tracer, planned, edges

    def install(self, model: nn.Module) -> None:
        """Each module of the (private) meta copy gets a class of its own whose __call__
        runs pre, forward, post: no module hooks fire, neither the copy's (copied from the
        model) nor global ones (CommDebugMode's module tracker, a user's)."""
        for path, module in model.named_modules():
            cls = type(module)
            module.__class__ = type(cls.__name__, (cls,), {"__call__": self.caller(path),
                                                           "__module__": cls.__module__})

    def caller(self, path):
        pre, post = self.pre(path), self.post(path)

        def call(module, *args, **kwargs):
            got = pre(module, args, kwargs)
            args, kwargs = got if got is not None else (args, kwargs)
            out = module.forward(*args, **kwargs)
            got = post(module, args, kwargs, out)
            return out if got is None else got
        return call

    def untagged(self, obj):
        """`obj` with its tensors replaced by aliases that carry no layout."""
        def alias(t):
            new = t.view_as(t)
            self.tracer.tag(new, None)
            return new
        return map_tensors(alias, obj)

    def hand(self, t, path, style, read, after, local):
        """A tensor entering `path` through `style`'s input hook: check, then re-tag."""
        tr = self.tracer
        if not isinstance(t, torch.Tensor) or read is None:
            return t
        flow = tr.flow(t)
        actual = normalized(flow.layout, t.ndim) if flow and flow.local else None
        expected = normalized(read, t.ndim)
        self.edges.append(Edge(flow.source if flow else None, path,
                               short_name(actual, t.ndim) if actual is not None else
                               "DTensor" if flow else "unknown",
                               layout_name(read) if actual is not None else None))
        if flow is not None and actual is not None and expected is not None \
                and actual != expected:
            raise _mismatch(flow, path, style, actual, read, t.ndim)
        new = t.view_as(t)
        after = normalized(after, t.ndim) if after is not None else None
        source = (path, type(style).__name__, path)
        if type(style) in _MOVE_ONLY and actual is not None and actual == after:
            source = (flow.source, flow.style, flow.via)  # passed on as it came
        tr.tag(new, Flow(after, local, *source) if after else None)
        return new

    def pre(self, path):
        def hook(module, args, kwargs):
            self.tracer.stack.append(path)
            styles = self.planned.get(path)
            if not styles:
                _needs_whole(self.tracer, path, module, args)
                return None
            if not all(map(known, styles)):  # inside it, judge nothing
                return self.untagged(args), self.untagged(kwargs)
            args = list(args)
            for style in styles:
                arg_rules, kw_rules = inputs_of(style, module)
                for i, read, after, local in arg_rules:
                    if i < len(args):
                        args[i] = self.hand(args[i], path, style, read, after, local)
                for k, (read, after, local) in kw_rules.items():
                    if k in kwargs:
                        kwargs[k] = self.hand(kwargs[k], path, style, read, after, local)
            if all(type(s) in _MOVE_ONLY for s in styles):  # its own weights stay whole
                _needs_whole(self.tracer, path, module, args,
                             f"whose weights {type(styles[0]).__name__} leaves whole")
            return tuple(args), kwargs
        return hook

    def post(self, path):
        def hook(module, args, kwargs, output):
            tr = self.tracer
            tr.stack.pop()
            styles = self.planned.get(path)
            if not styles:
                for _, t in tensors_of(output):
                    if (flow := tr.flow(t)) is not None:
                        tr.tag(t, dataclasses.replace(flow, via=path))
                return None
            if not all(map(known, styles)):
                for _, t in tensors_of(output):
                    tr.tag(t, None)  # a style not known here: nothing after it is checked
                return None
            for style in styles:
                rules = outputs_of(style, module)
                if rules:
                    output = self.leave(output, path, style, rules)
            return output
        return hook

    def leave(self, output, path, style, rules):
        single = not isinstance(output, tuple)
        outs = list((output,) if single else output)
        for i, (read, after, local) in enumerate(rules[:len(outs)]):
            t = outs[i]
            if not isinstance(t, torch.Tensor) or after is None:
                continue
            flow = self.tracer.flow(t)
            if read is not None and flow is not None and flow.local:  # PrepareModuleOutput
                actual, expected = normalized(flow.layout, t.ndim), normalized(read, t.ndim)
                if actual is not None and expected is not None and actual != expected:
                    raise _mismatch(flow, path, style, actual, read, t.ndim, output=True)
            new = t.view_as(t)
            self.tracer.tag(new, Flow(normalized(after, t.ndim), local, path, type(style).__name__,
                                      path))
            outs[i] = new
        return outs[0] if single else type(output)(outs)
