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
Module hooks record which planned module is called when, and a `TorchFunctionMode` carries
a small tag on every activation: the layout it would have on the ranks (a whole tensor, a
local shard of dim d, a DTensor) and the module it came from, moved along through views,
transposes, pointwise ops and attention. Why not torch.fx or torch.export: symbolic
tracing fails on ordinary control flow (transformers' models), and export needs the model
to be export-clean; a forward on meta runs any model that runs, and the tags follow the
Python ops the model actually calls. Where the tag cannot be followed (an op whose effect
on the sharded dim is unknown, a style this module does not know), it is dropped and
nothing downstream is checked: never a guess, never a false alarm on a plan that chains.

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
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tplab import plans
from tplab.errors import PlanError
from tplab.pytrees import map_tensors

KNOWN_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
                PrepareModuleOutput, PrepareModuleInputOutput)
INPUT = "the model's input"
# ops that contract or mix the last two dims: a shard there does not survive them
_MATMULS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "addmm", "baddbmm", "einsum",
            "linear", "bilinear", "conv1d", "conv2d", "conv3d", "tensordot"}
_TRANSPOSES = {"transpose", "swapaxes", "swapdims", "transpose_", "t", "permute", "movedim",
               "mT"}
_VIEWS = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "_unsafe_view"}


@dataclasses.dataclass(frozen=True)
class Flow:
    """What a tensor would be on the ranks: `layout` (Replicate(): whole on every rank;
    Shard(d), d >= 0 for this tensor's dims; Partial()), `local` (a plain tensor, not a
    DTensor), `source` (the planned module that gave it this layout; None: the model's
    input) and `via` (the last module it came out of)."""

    layout: object
    local: bool = True
    source: str | None = None
    style: str | None = None
    via: str | None = None

    def where(self) -> str:
        through = f", through {self.via}" if self.via and self.via != self.source else ""
        if self.source:
            return f"{self.source} ({self.style}{through})"
        return f"{INPUT} ({through[2:]})" if through else INPUT


@dataclasses.dataclass(frozen=True)
class Edge:
    """One hand-over the check looked at: `producer` (a planned module, or None for the
    model's input) gives `consumer` a tensor of `layout`; `expected` is how the consumer's
    style reads a plain tensor (None: a DTensor, redistributed as needed)."""

    producer: str | None
    consumer: str
    layout: str
    expected: str | None


def name(p) -> str:
    """Replicate(), Shard(-1), Partial(sum): placements as torch prints them in plans."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return "Partial(sum)"
    return f"{type(p).__name__}()"


def _norm(p, ndim: int):
    """A placement with Shard's dim made non-negative for a tensor of `ndim` dims."""
    if type(p) is Shard:
        return Shard(p.dim % ndim) if ndim else None
    return p if type(p) in (Replicate, Partial) else None  # _StridedShard etc: unknown


def _short(p, ndim: int) -> str:
    return "Shard(-1)" if type(p) is Shard and p.dim == ndim - 1 else name(p)


def _one(layouts):
    return layouts[0] if isinstance(layouts, tuple) else layouts


def _local_name(flow: Flow, ndim: int) -> str:
    p = flow.layout
    if type(p) is Shard:
        if p.dim == ndim - 1:
            return "a local tensor sharded on its last dim (Shard(-1))"
        return f"a local tensor sharded on dim {p.dim} (Shard({p.dim}))"
    if type(p) is Partial:
        return "a local tensor of partial sums (Partial(sum))"
    return "a whole tensor on every rank (Replicate())"


# --- following the layout through ops ---------------------------------------------------


def _view_dim(old: tuple, new: tuple, d: int) -> int | None:
    """Where a shard of dim d of `old` lands when viewed as `new` (contiguous reshape): in a
    group of dims with equal products, it must be the group's outermost dim of size > 1,
    and lands on the new group's outermost one (each rank's block stays contiguous)."""
    try:
        i = j = 0
        while i < len(old) and j < len(new):
            gi, gj, po, pn = [i], [j], old[i], new[j]
            while po != pn:
                if po < pn:
                    i += 1
                    gi.append(i)
                    po *= old[i]
                else:
                    j += 1
                    gj.append(j)
                    pn *= new[j]
            if d in gi:
                lead_old = [k for k in gi if old[k] != 1]
                lead_new = [k for k in gj if new[k] != 1]
                return lead_new[0] if lead_old and lead_old[0] == d and lead_new else None
            i, j = i + 1, j + 1
    except IndexError:
        return None
    return None


def _perm_dim(func_name: str, args, kwargs, ndim: int, d: int) -> int | None:
    rest = [a for a in args[1:]] + list(kwargs.values())
    if func_name in ("t", "mT"):
        return {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(d, d) if ndim >= 2 else d
    if func_name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        dims = [x % ndim for x in dims]
        return dims.index(d) if d in dims else None
    if func_name == "movedim" or len(rest) != 2 or not all(isinstance(x, int) for x in rest):
        return None
    a, b = (x % ndim for x in rest)
    return b if d == a else a if d == b else d


def _moved(func, args, kwargs, src: torch.Tensor, d: int, out: torch.Tensor) -> int | None:
    """The dim of `out` that holds the shard of dim d of `src`, or None (unknown)."""
    fname = getattr(func, "__name__", "")
    if fname in _TRANSPOSES:
        return _perm_dim(fname, args, kwargs, src.ndim, d)
    if fname in _VIEWS:
        return _view_dim(tuple(src.shape), tuple(out.shape), d)
    if fname in ("unsqueeze", "squeeze"):
        return _view_dim(tuple(src.shape), tuple(out.shape), d) if src.shape[d] != 1 else None
    if fname in ("repeat_interleave", "expand", "expand_as"):
        return d if out.ndim == src.ndim else None   # each rank repeats its own block
    if fname in _MATMULS:  # batch dims survive a matmul; the last two are contracted/mixed
        return d if out.ndim == src.ndim and d < src.ndim - 2 else None
    if fname == "scaled_dot_product_attention":  # heads and batch are independent
        return d if d < src.ndim - 2 and out.ndim == src.ndim else None  # GQA: fewer kv heads
    if fname in ("repeat", "tile", "roll", "flip", "cumsum", "sort", "argsort", "topk"):
        return None
    # pointwise, broadcasting, softmax over another dim, slicing elsewhere, cat/split on
    # another dim: the dim keeps its size (aligned from the right)
    shift = out.ndim - src.ndim
    if shift >= 0 and out.shape[d + shift] == src.shape[d] and src.shape[d] > 1:
        return d + shift
    return None


class _Tracer(TorchFunctionMode):
    """Carries a Flow on every activation of one meta forward; see the module docstring."""

    def __init__(self, tags: dict):
        super().__init__()
        self.tags, self.keep = tags, []
        self.stack: list[str] = []

    def tag(self, t, flow: Flow | None) -> None:
        if isinstance(t, torch.Tensor):
            if flow is None:
                self.tags.pop(id(t), None)
            else:
                self.tags[id(t)] = (t, flow)

    def flow(self, t) -> Flow | None:
        hit = self.tags.get(id(t)) if isinstance(t, torch.Tensor) else None
        return hit[1] if hit is not None and hit[0] is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [(t, f) for t in tree_flatten((args, kwargs))[0] if (f := self.flow(t))]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if ins and outs:
            for t in outs:
                self.tag(t, self._combine(func, args, kwargs, ins, t))
        return out

    def _combine(self, func, args, kwargs, ins, out) -> Flow | None:
        if any(not f.local for _, f in ins):  # a DTensor: DTensor propagates it
            return next(f for _, f in ins if not f.local)
        shards = [(t, f) for t, f in ins if type(f.layout) is Shard]
        if not shards:
            kinds = {type(f.layout) for _, f in ins}
            if len(kinds) != 1 or not kinds <= {Replicate, Partial}:
                return None
            return next((f for _, f in reversed(ins) if f.source), ins[0][1])
        dims = set()
        for t, f in shards:
            dims.add(_moved(func, args, kwargs, t, f.layout.dim, out))
        if len(dims) != 1 or None in dims:
            return None
        (dim,) = dims
        shard_t, shard_f = shards[0]
        for t, f in ins:  # a whole tensor next to a shard must broadcast along the shard
            if type(f.layout) is Replicate and t.ndim and (
                    k := dim - (out.ndim - t.ndim)) >= 0 and t.shape[k] > 1:
                raise _combined(func, shard_f, f, shard_t, self.stack)
        return dataclasses.replace(shard_f, layout=Shard(dim))


def _combined(func, shard: Flow, whole: Flow, t, stack) -> PlanError:
    where = f" in {stack[-1]}'s forward" if stack and stack[-1] else ""
    op = getattr(func, "__name__", str(func)).strip("_")
    return PlanError(
        f"layouts do not chain: {shard.where()} hands on {_local_name(shard, t.ndim)}, and "
        f"`{op}`{where} combines it with a whole tensor from {whole.where()} (Replicate()); "
        f"on the ranks their shapes differ. Fix: give {shard.source} output_layouts="
        "Replicate() (an all-gather), or end its region with a RowwiseParallel before the "
        "op (as Megatron pairs a column-parallel layer with a row-parallel one)")


# --- what each style expects and produces -------------------------------------------------


def _inputs_of(style, module) -> tuple[list, dict]:
    """([(arg index, layout read, layout after, local after)], {kwarg: ...}) of a style's
    input hook; layouts None where the style leaves an input alone."""
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
        args = [(i, lay, want, style.use_local_output) for i, (lay, want) in enumerate(
            zip(style.input_layouts or (), style.desired_input_layouts or (), strict=False))
            if lay is not None]
        kws = {k: (lay, style.desired_input_kwarg_layouts.get(k), style.use_local_output)
               for k, lay in (style.input_kwarg_layouts or {}).items() if lay is not None}
        return args, kws
    return [], {}


def _outputs_of(style) -> list | None:
    """[(layout read, layout handed on, local)] per output of a style's output hook; None
    where the style leaves the outputs alone."""
    if type(style) in (ColwiseParallel, RowwiseParallel):
        out = _one(style.output_layouts)
        return [(None, out, style.use_local_output)]
    if type(style) is SequenceParallel:
        return [(None, _one(style.sequence_sharding), style.use_local_output)]
    if type(style) is PrepareModuleInputOutput:
        style = style.prepare_module_output
    if type(style) is PrepareModuleOutput:
        return [(lay, want, style.use_local_output) for lay, want in
                zip(style.output_layouts, style.desired_output_layouts, strict=False)]
    return None


# --- the check ----------------------------------------------------------------------------


def _fix(flow: Flow, consumer: str, style, actual, expected, ndim: int) -> str:
    """A suggestion for a plain `actual` tensor read as `expected` by `consumer`'s style."""
    kind = type(style).__name__
    expected = _norm(expected, ndim)
    src = flow.source or flow.via
    last = Shard(ndim - 1)
    as_input = f"Shard({'-1' if actual == last else actual.dim})" if type(actual) is Shard \
        else name(actual)
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
            + (f", or change {src}'s output_layouts to {name(expected)}" if src else ""))


def _mismatch(flow: Flow, consumer: str, style, actual, expected, ndim: int,
              output: bool = False) -> PlanError:
    kind = type(style).__name__
    got = _local_name(dataclasses.replace(flow, layout=actual), ndim)
    if output:  # PrepareModuleOutput reads the module's own output
        return PlanError(
            f"layouts do not chain: {consumer} returns {got} (from {flow.where()}), but its "
            f"{kind} reads it as {name(expected)} (output_layouts). Fix: give {consumer}'s "
            f"{kind} output_layouts={name(actual)}")
    reads = "sequence_sharding" if type(style) is SequenceParallel else "input_layouts"
    return PlanError(
        f"layouts do not chain: {flow.where()} hands {consumer} ({kind}) {got}, but "
        f"{consumer}'s {kind} reads a plain input as {name(expected)} ({reads}); on the "
        f"ranks its shapes would not fit. Fix: "
        f"{_fix(flow, consumer, style, actual, expected, ndim)}")


def _needs_whole(tracer: _Tracer, path: str, module: nn.Module, args) -> None:
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
        f"{_local_name(flow, x.ndim)}, but {path} {what} "
        f"{'its last dim' if span == 1 else f'its last {span} dims'} and needs it whole "
        f"on every rank{' (the sums are still pending)' if partial else ''}. Fix: {fix}")


class _Hooks:
    """Forward (pre-)hooks on every module of the meta copy: check and re-tag."""

    def __init__(self, tracer: _Tracer, planned: dict, edges: list):
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

    def hand(self, t, path, style, read, after, local):
        """A tensor entering `path` through `style`'s input hook: check, then re-tag."""
        tr = self.tracer
        if not isinstance(t, torch.Tensor) or read is None:
            return t
        flow = tr.flow(t)
        actual = _norm(flow.layout, t.ndim) if flow and flow.local else None
        expected = _norm(read, t.ndim)
        self.edges.append(Edge(flow.source if flow else None, path,
                               _short(actual, t.ndim) if actual is not None else
                               "DTensor" if flow else "unknown",
                               name(read) if actual is not None else None))
        if flow is not None and actual is not None and expected is not None \
                and actual != expected:
            raise _mismatch(flow, path, style, actual, read, t.ndim)
        new = t.view_as(t)
        after = _norm(after, t.ndim) if after is not None else None
        tr.tag(new, Flow(after, local, path, type(style).__name__, path) if after else None)
        return new

    def pre(self, path):
        def hook(module, args, kwargs):
            self.tracer.stack.append(path)
            styles = self.planned.get(path)
            if not styles:
                _needs_whole(self.tracer, path, module, args)
                return None
            args = list(args)
            for style in styles:
                if type(style) not in KNOWN_STYLES:
                    continue
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
            if any(type(s) not in KNOWN_STYLES for s in styles):
                for _, t in _tensors(output):
                    tr.tag(t, None)  # a style not known here: nothing after it is checked
                return None
            for style in styles:
                rules = _outputs_of(style)
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
                actual, expected = _norm(flow.layout, t.ndim), _norm(read, t.ndim)
                if actual is not None and expected is not None and actual != expected:
                    raise _mismatch(flow, path, style, actual, read, t.ndim, output=True)
            new = t.view_as(t)
            self.tracer.tag(new, Flow(_norm(after, t.ndim), local, path, type(style).__name__,
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


def styles_by_module(model: nn.Module, plan: dict) -> dict[str, list]:
    """{module path: [styles]} as parallelize_module applies a plan (fnmatch keys)."""
    found: dict[str, list] = {}
    for key, style in plan.items():
        for path, _ in plans.match(model, key):
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
    arguments, raises a PlanError before the parallel forward starts, and removes itself."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    meta = _meta_copy(model)

    def first_call(module, args, kwargs):
        handle.remove()
        _trace(meta, plan, args, kwargs)

    handle = model.register_forward_pre_hook(first_call, prepend=True, with_kwargs=True)


def _trace(meta: nn.Module, plan: dict, args: tuple, kwargs: dict) -> list[Edge] | None:
    """One forward of the meta copy with the tracer, in a thread of its own: torch's mode
    stacks (dispatch and function modes: LocalTensorMode, CommDebugMode, tplab.trace) and
    grad mode are per thread, so nothing the caller has switched on sees this forward."""
    args, kwargs = _on_meta(args), _on_meta(kwargs)
    result: dict = {}

    def work():
        try:
            result["edges"] = _trace_here(meta, plan, args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name="tplab-plan-check")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["edges"]


def _trace_here(meta, plan, args, kwargs) -> list[Edge] | None:
    planned = styles_by_module(meta, plan)
    edges: list[Edge] = []
    tracer = _Tracer({})
    _Hooks(tracer, planned, edges).install(meta)
    for _, t in _tensors((args, kwargs)):
        tracer.tag(t, Flow(Replicate()))
    with torch.no_grad():
        try:
            with tracer:
                meta(*args, **kwargs)
        except PlanError:
            raise
        except Exception:  # noqa: BLE001 - a model that does not run on meta: not checked
            return None
    return edges
