"""Does a plan's layouts chain? A static check of a plan against the model's dataflow.

`parallelize_module` installs each style's hooks without asking whether one module's
output is what the next module expects. A plain (local) tensor carries no placement:
`DTensor.from_local(x, mesh, input_layouts)` in the next style's input hook simply
*believes* its `input_layouts`. So a ColwiseParallel feeding a ColwiseParallel (a Shard(-1)
shard read as a whole Replicate() tensor) only shows up at run time, deep inside DTensor's
sharding propagation ("a and b must have same reduction dim"), with torch's fake-tensor
log on every rank. This module finds such mistakes before anything runs, and names both
modules, both placements and a fix.

How the dataflow is found: one forward pass of a copy of the model whose parameters are on
the meta device (no memory, no arithmetic), with the user's example input also on meta.
Each module's call records which planned module is called when, and a `TorchFunctionMode`
(`tplab.layout_flow`) carries a small tag on every activation: the layout it would have on
the ranks (a whole tensor, a local shard of dim d, a DTensor) and the module it came from,
moved along through views, transposes, pointwise ops and attention. Why not torch.fx or
torch.export: symbolic tracing fails on ordinary control flow (transformers' models), and
export needs the model to be export-clean; a forward on meta runs any model that runs, and
the tags follow the Python ops the model actually calls. Where the tag cannot be followed
(an op whose effect on the sharded dim is unknown, a style this module does not know: in
and below it), it is dropped and nothing downstream is checked: never a guess, never a
false alarm on a plan that chains. The forward runs in a thread of its own, each module
called through its own class, so that no mode (LocalTensorMode, CommDebugMode,
`tplab.trace`) and no module hook of the caller sees it.

What each style expects and produces is read from torch's own definitions
(torch/distributed/tensor/parallel/style.py): ColwiseParallel / RowwiseParallel /
SequenceParallel read a plain input as `input_layouts` (`sequence_sharding`) and hand on
`output_layouts`, as a plain tensor when `use_local_output`; a DTensor input is
redistributed, so it always fits. PrepareModuleInput / PrepareModuleOutput /
PrepareModuleInputOutput do the same per argument. Other styles (transformers', tplab's
own, subclasses) are skipped.

Mistakes found: a local shard read as another layout (Colwise into Colwise: Shard(-1) read
as Replicate(); a whole tensor into a Rowwise: Replicate() read as Shard(-1); a sequence
shard into a Colwise); a local shard of the dim a module needs whole (an unplanned
nn.Linear on its last dim, a norm over its normalized dims); a local shard combined with
a whole tensor in an op (a residual add after a Colwise left sharded).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from fnmatch import fnmatch

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils._pytree import tree_flatten

from tplab import placements
from tplab.errors import PlanError
from tplab.layout_flow import (
    Flow,
    Tracer,
    layout_name,
    local_description,
    normalized,
    short_name,
)
from tplab.pytrees import map_tensors

KNOWN_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
                PrepareModuleOutput, PrepareModuleInputOutput)


@dataclasses.dataclass(frozen=True)
class Edge:
    """One hand-over the check looked at: `producer` (a planned module, or None for the
    model's input) gives `consumer` a tensor of `layout`; `expected` is how the consumer's
    style reads a plain tensor (None: a DTensor, redistributed as needed)."""

    producer: str | None
    consumer: str
    layout: str
    expected: str | None


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


# --- what each style expects and produces -------------------------------------------------


def _inputs_of(style, module) -> tuple[list, dict]:
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


def _outputs_of(style, module) -> list | None:
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


# --- the check ----------------------------------------------------------------------------


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


def _needs_whole(tracer: Tracer, path: str, module: nn.Module, args) -> None:
    """An unplanned module that needs whole the dim a local shard splits."""
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
        f"layouts do not chain: {flow.where()} hands {path} ({kind}, not in the plan) "
        f"{local_description(flow, x.ndim)}, but {path} {what} "
        f"{'its last dim' if span == 1 else f'its last {span} dims'} and needs it whole "
        f"on every rank{' (the sums are still pending)' if partial else ''}. Fix: {fix}")


class _Hooks:
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
        tr.tag(new, Flow(after, local, path, type(style).__name__, path) if after else None)
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
                arg_rules, kw_rules = _inputs_of(style, module)
                for i, read, after, local in arg_rules:
                    if i < len(args):
                        args[i] = self.hand(args[i], path, style, read, after, local)
                for k, (read, after, local) in kw_rules.items():
                    if k in kwargs:
                        kwargs[k] = self.hand(kwargs[k], path, style, read, after, local)
            return tuple(args), kwargs
        return hook

    def post(self, path):
        def hook(module, args, kwargs, output):
            tr = self.tracer
            tr.stack.pop()
            styles = self.planned.get(path)
            if not styles:
                for _, t in _tensors(output):
                    if (flow := tr.flow(t)) is not None:
                        tr.tag(t, dataclasses.replace(flow, via=path))
                return None
            if not all(map(known, styles)):
                for _, t in _tensors(output):
                    tr.tag(t, None)  # a style not known here: nothing after it is checked
                return None
            for style in styles:
                rules = _outputs_of(style, module)
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


def _tensors(obj):
    return [(None, t) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter, buffer and tensor attribute on the meta device
    (copy.deepcopy's memo maps each to its meta twin: no real data is copied)."""
    memo: dict = {}
    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(),
                      *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                twin = torch.empty(value.shape, dtype=value.dtype, device="meta")
                memo[id(value)] = (nn.Parameter(twin, value.requires_grad)
                                   if isinstance(value, nn.Parameter) else twin)
    return copy.deepcopy(model, memo)


def _on_meta(x):
    """Tensors (DTensors and simulated LocalTensors too) as meta tensors of their global
    shape."""
    return map_tensors(lambda t: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta"), x)


def match(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The (path, module) pairs a plan key selects, with parallelize_module's fnmatch rule."""
    found = [("", model)]
    for token in key.split(".") if key else []:
        found = [(f"{path}.{name}" if path else name, child)
                 for path, module in found for name, child in module.named_children()
                 if fnmatch(name, token)]
    return found


def styles_by_module(model: nn.Module, plan: dict) -> dict[str, list]:
    """{module path: [styles]} as parallelize_module applies a plan (fnmatch keys)."""
    found: dict[str, list] = {}
    for key, style in plan.items():
        for path, _ in match(model, key):
            found.setdefault(path, []).append(style)
    return found


def check_layouts(model: nn.Module, plan: dict, example_input) -> list[Edge] | None:
    """Raise a PlanError naming both modules, both placements and a fix where one planned
    module's output does not fit what the next one reads (see the module docstring).

    `example_input` is what the model is called with (a tensor: model(x); a tuple or list:
    model(*x); a dict: model(**x), as `grad_check`'s make_input gives). Returns the
    hand-overs checked (producer, consumer, layout, expected) in dataflow order; None when
    the model could not run on the meta device (then nothing is checked: the plan is
    neither passed nor failed) or is parallelised already."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    if isinstance(example_input, dict):
        return _trace(_meta_copy(model), plan, (), example_input)
    if isinstance(example_input, (tuple, list)) and not hasattr(example_input, "_fields"):
        return _trace(_meta_copy(model), plan, tuple(example_input), {})
    return _trace(_meta_copy(model), plan, (example_input,), {})


def check_at_first_call(model: nn.Module, plan: dict) -> None:
    """Check the layouts when `model` is first called (for `apply_plan`, which has no
    example input): a pre-hook on the root, run before any style's hook, traces a meta
    copy taken now (whole shapes, before parallelize_module) with the call's own
    arguments, raises a PlanError before the parallel forward starts, and removes itself.
    The call's inputs may be the rank's own shards, so their layout is not assumed: what
    the planned modules hand on is checked (a Colwise into a Colwise), not what the model
    is fed (`check_layouts` with the whole example input checks that too)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    meta = _meta_copy(model)

    def first_call(module, args, kwargs):
        handle.remove()
        # what the ranks pass in may be their own shards (a sequence-parallel block fed
        # local Shard(1) pieces): the inputs' layout is unknown, only what planned modules
        # hand on is followed
        _trace(meta, plan, args, kwargs, whole_inputs=False)

    handle = model.register_forward_pre_hook(first_call, prepend=True, with_kwargs=True)


def _trace(meta: nn.Module, plan: dict, args: tuple, kwargs: dict,
           whole_inputs: bool = True) -> list[Edge] | None:
    """One forward of the meta copy with the tracer, in a thread of its own: torch's mode
    stacks (dispatch and function modes: LocalTensorMode, CommDebugMode, tplab.trace) and
    grad mode are per thread, so nothing the caller has switched on sees this forward."""
    args, kwargs = _on_meta(args), _on_meta(kwargs)
    result: dict = {}

    def work():
        try:
            result["edges"] = _trace_here(meta, plan, args, kwargs, whole_inputs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name="tplab-plan-check")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["edges"]


def _trace_here(meta, plan, args, kwargs, whole_inputs: bool) -> list[Edge] | None:
    planned = styles_by_module(meta, plan)
    edges: list[Edge] = []
    tracer = Tracer({})
    _Hooks(tracer, planned, edges).install(meta)
    for _, t in _tensors((args, kwargs)) if whole_inputs else ():
        tracer.tag(t, Flow(Replicate()))  # as grad_check sends it: whole to every rank
    with torch.no_grad():
        try:
            with tracer:
                meta(*args, **kwargs)
        except PlanError:
            raise
        except Exception:  # noqa: BLE001 - a model that does not run on meta: not checked
            return None
    return edges
