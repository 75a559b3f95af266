"""How a tensor's layout on the ranks moves through the ops of one forward pass.

`tplab.plan_check` runs a model on the meta device and needs to know, for every activation,
what it would be on the ranks of the parallel model: a whole tensor on every rank, a local
shard of one dim, a DTensor. `Flow` is that tag; `Tracer` (a TorchFunctionMode) moves it
from each op's inputs to its outputs: through views and reshapes (a contiguous reshape
keeps a shard on the outermost dim of its group), transposes and permutes, pointwise ops
and broadcasting, batched matmuls and scaled-dot-product attention (their batch and head
dims), repeat_interleave (GQA). An op whose effect on the sharded dim is not one of these
drops the tag: what follows is not judged. A local shard combined with a whole tensor of
full size along the shard (a residual add after a column-parallel layer left sharded)
raises a PlanError at once: on the ranks their shapes differ. So does an op that reduces
over (or scans along) the sharded dim (`reduced_dims`: F.layer_norm, softmax, norm,
mean/sum/var/std/amax/max, logsumexp, cumsum, cross_entropy, ...): each rank would reduce
its own shard, wrong values without an error; over another dim the shard follows.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tplab.core import placements
from tplab.errors import PlanError

INPUT = "the model's input"
# ops that contract or mix the last two dims: a shard there does not survive them
_MATMULS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "addmm", "baddbmm", "einsum",
            "linear", "bilinear", "conv1d", "conv2d", "conv3d", "tensordot"}
_TRANSPOSES = {"transpose", "swapaxes", "swapdims", "transpose_", "t", "permute", "movedim",
               "mT"}
_VIEWS = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "_unsafe_view"}
# ops that reduce over (or scan along) the dims they are given: (position of `dim` in the
# positional arguments, its default; None: every dim)
_REDUCTIONS = {name: (1, None) for name in (
    "sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "aminmax", "logsumexp", "var",
    "std", "var_mean", "std_mean", "max", "min", "argmax", "argmin", "all", "any", "median",
    "nanmedian", "mode", "count_nonzero")}
_REDUCTIONS |= {name: (1, "required") for name in (
    "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp")}
_REDUCTIONS |= {"sort": (1, -1), "argsort": (1, -1), "topk": (2, -1), "kthvalue": (2, -1),
                "norm": (2, None), "linalg_vector_norm": (2, None), "vector_norm": (2, None),
                "normalize": (2, 1), "quantile": (2, None), "nanquantile": (2, None)}


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


def layout_name(p) -> str:
    """Replicate(), Shard(-1), Partial(sum): placements as torch prints them in plans."""
    if isinstance(p, Partial):
        return placements.PARTIAL  # a plan's Partial is a sum (RowwiseParallel's output)
    return placements.name(p)


def normalized(p, ndim: int):
    """A placement with Shard's dim made non-negative for a tensor of `ndim` dims."""
    if type(p) is Shard:
        return Shard(p.dim % ndim) if ndim else None
    return p if type(p) in (Replicate, Partial) else None  # _StridedShard etc: unknown


def short_name(p, ndim: int) -> str:
    return placements.shard(-1) if type(p) is Shard and p.dim == ndim - 1 else layout_name(p)


def local_description(flow: Flow, ndim: int) -> str:
    p = flow.layout
    if type(p) is Shard:
        if p.dim == ndim - 1:
            return "a local tensor sharded on its last dim (Shard(-1))"
        return f"a local tensor sharded on dim {p.dim} (Shard({p.dim}))"
    if type(p) is Partial:
        return "a local tensor of partial sums (Partial(sum))"
    return "a whole tensor on every rank (Replicate())"


# --- following the layout through ops ---------------------------------------------------


def view_dim(old: tuple, new: tuple, d: int) -> int | None:
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


def permuted_dim(func_name: str, args, kwargs, ndim: int, d: int) -> int | None:
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


def moved_dim(func, args, kwargs, src: torch.Tensor, d: int, out: torch.Tensor) -> int | None:
    """The dim of `out` that holds the shard of dim d of `src`, or None (unknown)."""
    fname = getattr(func, "__name__", "")
    if fname in _TRANSPOSES:
        return permuted_dim(fname, args, kwargs, src.ndim, d)
    if fname in _VIEWS:
        return view_dim(tuple(src.shape), tuple(out.shape), d)
    if fname in ("unsqueeze", "squeeze"):
        return view_dim(tuple(src.shape), tuple(out.shape), d) if src.shape[d] != 1 else None
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


def _dims_given(value, ndim: int) -> set[int] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value % ndim} if ndim else set()
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        return {v % ndim for v in value} if ndim else set()
    return None


def reduced_dims(fname: str, args, kwargs, src: torch.Tensor) -> set[int] | None:
    """The dims of `src` (the op's first argument) that the op reduces over or scans along
    (each rank would see only its own part of a sharded one); None: not such an op, or
    dims that cannot be read."""
    ndim = src.ndim
    if fname in ("layer_norm", "rms_norm"):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        span = 1 if isinstance(shape, int) else len(shape or ())
        return set(range(ndim - span, ndim))
    if fname in ("group_norm", "cross_entropy", "nll_loss"):
        if fname != "group_norm" and kwargs.get("reduction", "mean") == "none":
            return {1 % ndim} if ndim else set()  # the classes
        return set(range(min(1, ndim - 1) if fname == "group_norm" else 0, ndim))
    rule = _REDUCTIONS.get(fname)
    if rule is None:
        return None
    pos, default = rule
    given = kwargs.get("dim", args[pos] if len(args) > pos else default)
    if fname in ("max", "min") and isinstance(given, torch.Tensor):
        return None  # the elementwise max(a, b)
    if fname in ("var", "std", "var_mean", "std_mean") and isinstance(given, bool):
        given = kwargs.get("dim")  # the old (unbiased) signature
    if given is None:
        return set(range(ndim)) if default != "required" else (
            {0 if ndim in (0, 1, 3) else 1} if ndim else set())  # softmax's implicit dim
    return _dims_given(given, ndim)


def reduced_error(func, flow: Flow, t, dim: int, stack) -> PlanError:
    where = f" in {stack[-1]}'s forward" if stack and stack[-1] else ""
    op = getattr(func, "__name__", str(func)).strip("_")
    src = flow.source or flow.via
    return PlanError(
        f"layouts do not chain: {flow.where()} hands on {local_description(flow, t.ndim)}, "
        f"and `{op}`{where} reduces over dim {dim}, the sharded one; on the ranks each rank "
        f"would reduce only its own shard (wrong values, and no error). Fix: give {src} "
        "output_layouts=Replicate() (an all-gather) before the op, or end the sharded region "
        "with a RowwiseParallel before it (as Megatron pairs a column-parallel layer with a "
        "row-parallel one)")


class Tracer(TorchFunctionMode):
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
        fname = getattr(func, "__name__", "")
        first = args[0] if args else None
        dims = set()
        for t, f in shards:
            reduced = reduced_dims(fname, args, kwargs, t) if t is first else None
            if reduced is not None and f.layout.dim in reduced:
                raise reduced_error(func, f, t, f.layout.dim, self.stack)
            if reduced is not None and out.ndim == t.ndim - len(reduced):  # dims dropped
                dims.add(f.layout.dim - sum(r < f.layout.dim for r in reduced))
                continue
            dims.add(moved_dim(func, args, kwargs, t, f.layout.dim, out))
        if len(dims) != 1 or None in dims:
            return None
        (dim,) = dims
        shard_t, shard_f = shards[0]
        for t, f in ins:  # a whole tensor next to a shard must broadcast along the shard
            if type(f.layout) is Replicate and t.ndim and (
                    k := dim - (out.ndim - t.ndim)) >= 0 and t.shape[k] > 1:
                raise combined_error(func, shard_f, f, shard_t, self.stack)
        return dataclasses.replace(shard_f, layout=Shard(dim))


def combined_error(func, shard: Flow, whole: Flow, t, stack) -> PlanError:
    where = f" in {stack[-1]}'s forward" if stack and stack[-1] else ""
    op = getattr(func, "__name__", str(func)).strip("_")
    return PlanError(
        f"layouts do not chain: {shard.where()} hands on {local_description(shard, t.ndim)}, and "
        f"`{op}`{where} combines it with a whole tensor from {whole.where()} (Replicate()); "
        f"on the ranks their shapes differ. Fix: give {shard.source} output_layouts="
        "Replicate() (an all-gather), or end its region with a RowwiseParallel before the "
        "op (as Megatron pairs a column-parallel layer with a row-parallel one)")
