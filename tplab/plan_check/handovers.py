"""Each hand-over between a model's modules, checked as `tplab.plan_check` runs the meta
copy: hooks on every module compare the layout a tensor arrives with (its `layout_flow`
tag) against what the receiving style reads (its `tplab.style_specs.StyleSpec`), re-tag
what the style hands on, and raise a PlanError that names both modules, both placements and a fix.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.utils._pytree import tree_flatten

from tplab.core import placements
from tplab.core.pytrees import map_tensors
from tplab.errors import PlanError
from tplab.plan_check.tags import (
    Flow,
    Tracer,
    layout_name,
    local_description,
    normalized,
    short_name,
)
from tplab.style_specs import Handover, StyleSpec, spec_of


def moves_only(spec: StyleSpec) -> bool:
    """A style that only moves a module's inputs or outputs (PrepareModuleInput, ...): it
    gives no parameter a placement, so the module computes with whole weights."""
    return not spec.params and (bool(spec.inputs) or spec.outputs is not None)


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

    def hand(self, t, path, style, spec: StyleSpec, h: Handover):
        """A tensor entering `path` through `style`'s input hook: check, then re-tag."""
        tr, read, after, local = self.tracer, h.read, h.after, h.local
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
        if moves_only(spec) and actual is not None and actual == after:
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
            specs = [spec_of(style, module) for style in styles]
            if not all(s is not None and s.layouts_known for s in specs):
                return self.untagged(args), self.untagged(kwargs)  # inside it, judge nothing
            args = list(args)
            for style, spec in zip(styles, specs, strict=True):
                for h in spec.inputs:
                    if isinstance(h.index, int) and h.index < len(args):
                        args[h.index] = self.hand(args[h.index], path, style, spec, h)
                    elif h.index in kwargs:
                        kwargs[h.index] = self.hand(kwargs[h.index], path, style, spec, h)
            if all(map(moves_only, specs)):  # its own weights stay whole
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
            specs = [spec_of(style, module) for style in styles]
            if not all(s is not None and s.layouts_known for s in specs):
                for _, t in tensors_of(output):
                    tr.tag(t, None)  # a style not known here: nothing after it is checked
                return None
            for style, spec in zip(styles, specs, strict=True):
                if spec.outputs:
                    output = self.leave(output, path, style, spec.outputs)
            return output
        return hook

    def leave(self, output, path, style, rules):
        single = not isinstance(output, tuple)
        outs = list((output,) if single else output)
        for i, h in enumerate(rules[:len(outs)]):
            t = outs[i]
            if not isinstance(t, torch.Tensor) or h.after is None:
                continue
            flow = self.tracer.flow(t)
            if h.believed and h.read is not None and flow is not None and flow.local:
                actual, expected = normalized(flow.layout, t.ndim), normalized(h.read, t.ndim)
                if actual is not None and expected is not None and actual != expected:
                    raise _mismatch(flow, path, style, actual, h.read, t.ndim, output=True)
            new = t.view_as(t)
            after = normalized(h.after, t.ndim)  # None: a layout not followed (_StridedShard)
            self.tracer.tag(new, Flow(after, h.local, path, type(style).__name__, path)
                            if after is not None else None)
            outs[i] = new
        return outs[0] if single else type(output)(outs)
