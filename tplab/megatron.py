"""Megatron-LM's tensor parallelism written by hand: the conjugate operators and parallel layers.

Shoeybi et al., "Megatron-LM" (2019), section 3, and Korthikanti et al., "Reducing Activation
Recomputation" (2022) for sequence parallelism. Each autograd Function below is one operator of
the papers; its docstring names the counterpart in megatron/core/tensor_parallel/mappings.py.

| function           | forward                  | backward                 | Megatron            |
|--------------------|--------------------------|--------------------------|---------------------|
| copy_to_tp         | identity                 | all-reduce               | f                   |
| reduce_from_tp     | all-reduce               | identity                 | g                   |
| scatter_to_tp      | split (keep my chunk)    | all-gather               | scatter             |
| gather_from_tp     | all-gather               | split                    | gather              |
| all_gather_seq     | all-gather on dim        | reduce-scatter on dim    | g (SP)              |
| reduce_scatter_seq | reduce-scatter on dim    | all-gather on dim        | g-bar (SP)          |

The SP names are Korthikanti et al.'s (section 4.2.2, Figure 5): g is the all-gather in the
forward pass and the reduce-scatter in the backward pass, entering a TP region (where f
was); g-bar is the reverse, leaving it (where Megatron-LM's first paper has its g).

Every function takes the mesh (or a process group) explicitly: no global singleton. Pass a
DeviceMesh inside `tplab.simulate`: the rank comes from `mesh.get_local_rank()`, which the
simulation answers for every rank at once.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tplab import models
from tplab.errors import PlanError
from tplab.mesh import split, tp_group, tp_mesh  # noqa: F401 (megatron.split, .tp_group)

# --- the collectives, on one dim ---------------------------------------------------------

def _single(name: str, before_2_13: str):
    """torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single."""
    return getattr(dist, name, None) or getattr(dist, before_2_13)


def _all_reduce(x, group):
    x = x.contiguous().clone()  # never reduce into a tensor autograd may still hold
    dist.all_reduce(x, group=group)
    return x


def all_reduce_grad(grad, mesh):
    """A gradient hook: sum a replicated parameter's partial gradient over the tp ranks."""
    return _all_reduce(grad, tp_group(mesh)[0])


# The name `tplab.trace` gives an operator's collectives (a record's "cause") is the `label`
# of the Function (or hook) that issues them (`tplab.causes.find_cause`; `Trace.explain()`).
all_reduce_grad.label = "dW all-reduce"


def _all_gather(x, group, size, dim):
    # all_gather_single stacks on dim 0: move `dim` there and back.
    # (b, s/n, d) -> (s/n, b, d) -> gather -> (s, b, d) -> (b, s, d)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    _single("all_gather_single", "all_gather_into_tensor")(out, x, group=group)
    # contiguous: the linears this feeds save their input for backward, and a strided view
    # makes each of them flatten (copy) it, one saved copy per linear (tplab.memory shows it)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x, group, size, dim):
    # (b, s, d) -> (s, b, d) -> reduce-scatter -> (s/n, b, d) -> (b, s/n, d)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _single("reduce_scatter_single", "reduce_scatter_tensor")(out, x, group=group)
    return out.movedim(0, dim)


_split = split


def _check_divisible(what, length, size):
    if length % size:
        raise PlanError(f"{what} has size {length}, not divisible by the tp size {size}")


# --- the conjugate operators -------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (Megatron `_CopyToModelParallelRegion`)."""

    label = "f"

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # dL/dx = sum over ranks of (dy_r/dx)^T dL/dy_r: each rank holds one term
        return _all_reduce(grad, ctx.group), None


class CopyToTPNoReduce(torch.autograd.Function):
    """f with its backward all-reduce removed: the bug the lessons show (input grads wrong)."""

    label = "f"

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (Megatron `_ReduceFromModelParallelRegion`)."""

    label = "g"

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToTP(torch.autograd.Function):
    """Split on `dim`, keep my chunk; backward all-gathers (Megatron
    `_ScatterToModelParallelRegion`; on the sequence dim `_ScatterToSequenceParallelRegion`).
    """

    label = "scatter"

    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.args = group, size, dim
        return _split(x, size, rank, dim)

    @staticmethod
    def backward(ctx, grad):
        group, size, dim = ctx.args
        return _all_gather(grad, group, size, dim), None, None, None, None


class GatherFromTP(torch.autograd.Function):
    """All-gather on `dim`; backward keeps my chunk (Megatron `_GatherFromModelParallelRegion`)."""

    label = "gather"

    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.args = size, rank, dim
        return _all_gather(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        size, rank, dim = ctx.args
        return _split(grad, size, rank, dim), None, None, None, None


class AllGatherSeq(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward
    (Megatron `_GatherFromSequenceParallelRegion`; the g of sequence parallelism in
    Korthikanti et al. 2022, section 4.2.2).
    """

    label = "sp all-gather"

    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.args = group, size, dim
        return _all_gather(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, *ctx.args), None, None, None


class ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward
    (Megatron `_ReduceScatterToSequenceParallelRegion`; the g-bar of sequence
    parallelism in Korthikanti et al. 2022, section 4.2.2).
    """

    label = "sp reduce-scatter"

    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.args = group, size, dim
        return _reduce_scatter(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None


# {operator's name: the label its collectives carry in a trace}
OPERATORS = {op.__name__: op.label for op in (
    CopyToTP, CopyToTPNoReduce, ReduceFromTP, ScatterToTP, GatherFromTP, AllGatherSeq,
    ReduceScatterSeq, all_reduce_grad)}


def copy_to_tp(x: torch.Tensor, mesh, *, reduce_grad: bool = True) -> torch.Tensor:
    """f (Megatron `copy_to_tensor_model_parallel_region`): identity forward, all-reduce
    backward. `reduce_grad=False` builds f without its backward all-reduce, to see what
    breaks: every rank's input gradient is then only its own share of the sum."""
    if not reduce_grad:
        return CopyToTPNoReduce.apply(x)
    return CopyToTP.apply(x, tp_group(mesh)[0])


def reduce_from_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """g (Megatron `reduce_from_tensor_model_parallel_region`): all-reduce forward, identity
    backward; sums the ranks' partial outputs."""
    return ReduceFromTP.apply(x, tp_group(mesh)[0])


def scatter_to_tp(x: torch.Tensor, mesh, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of `dim` (default: the last); backward all-gathers
    (Megatron `scatter_to_tensor_model_parallel_region`)."""
    group, size, rank = tp_group(mesh)
    _check_divisible(f"dim {dim} of the input", x.shape[dim], size)
    return ScatterToTP.apply(x, group, size, rank, dim)


def gather_from_tp(x: torch.Tensor, mesh, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' chunks on `dim` (default: the last); backward keeps this
    rank's chunk (Megatron `gather_from_tensor_model_parallel_region`)."""
    group, size, rank = tp_group(mesh)
    return GatherFromTP.apply(x, group, size, rank, dim)


def all_gather_seq(x: torch.Tensor, mesh, dim: int = 1) -> torch.Tensor:
    """Sequence-sharded -> whole sequence entering a TP region: all-gather forward,
    reduce-scatter backward; replaces f under SP (Megatron
    `gather_from_sequence_parallel_region`)."""
    group, size, _ = tp_group(mesh)
    return AllGatherSeq.apply(x, group, size, dim)


def reduce_scatter_seq(x: torch.Tensor, mesh, dim: int = 1) -> torch.Tensor:
    """Partial sums -> summed and sequence-sharded leaving a TP region: reduce-scatter
    forward, all-gather backward; replaces g under SP (Megatron
    `reduce_scatter_to_sequence_parallel_region`)."""
    group, size, _ = tp_group(mesh)
    _check_divisible(f"dim {dim} (sequence)", x.shape[dim], size)
    return ReduceScatterSeq.apply(x, group, size, dim)


# --- parallel layers ---------------------------------------------------------------------

def _shard(t: torch.Tensor | None, size: int, rank, dim: int):
    if t is None:
        return None
    return nn.Parameter(_split(t.detach(), size, rank, dim).clone())


class ColumnParallelLinear(nn.Module):
    """Megatron `ColumnParallelLinear`: Y = X A with A split by columns, so Y_r = X A_r.

    Built from a full `nn.Linear`: this rank keeps rows [r*out/n, (r+1)*out/n) of its
    weight (out, in), i.e. columns of A = weight^T. `copy_input` applies f to X first (turn
    it off when one f already feeds several layers, e.g. q, k and v); `gather_output`
    all-gathers Y. `tp_placements` says how each parameter relates to the full one.
    """

    tp_placements = {"weight": Shard(0), "bias": Shard(0)}

    def __init__(self, linear: nn.Linear, mesh, *, copy_input: bool = True,
                 gather_output: bool = False, reduce_grad: bool = True):
        super().__init__()
        _, size, rank = tp_group(mesh)
        _check_divisible("out_features", linear.out_features, size)
        self.mesh, self.copy_input, self.gather_output = mesh, copy_input, gather_output
        self.reduce_grad = reduce_grad
        self.in_features, self.out_features = linear.in_features, linear.out_features // size
        self.weight = _shard(linear.weight, size, rank, 0)
        self.bias = _shard(linear.bias, size, rank, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.mesh, reduce_grad=self.reduce_grad)
        y = F.linear(x, self.weight, self.bias)  # (b, s, in) @ (in, out/n) -> (b, s, out/n)
        return gather_from_tp(y, self.mesh) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Megatron `RowParallelLinear`: Y = X A with A split by rows and X by columns:
    Y = sum_r X_r A_r, summed by g (or reduce-scattered on the sequence under SP).

    The bias is added once, after the sum (every rank adding it would count it n times).
    Under sequence parallelism it is added to this rank's sequence shard, so its gradient
    sums only that shard: a gradient hook all-reduces it over tp (Megatron marks such
    parameters `sequence_parallel` and all-reduces them in `finalize_model_grads`).
    """

    tp_placements = {"weight": Shard(1), "bias": Replicate()}

    def __init__(self, linear: nn.Linear, mesh, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        _, size, rank = tp_group(mesh)
        _check_divisible("in_features", linear.in_features, size)
        self.mesh, self.input_is_parallel = mesh, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = linear.in_features // size, linear.out_features
        self.weight = _shard(linear.weight, size, rank, 1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        if sequence_parallel and self.bias is not None:
            self.bias.register_hook(functools.partial(all_reduce_grad, mesh=mesh))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.mesh)
        y = F.linear(x, self.weight)  # (b, s, in/n) @ (in/n, out) -> (b, s, out), partial
        y = reduce_scatter_seq(y, self.mesh) if self.sequence_parallel else reduce_from_tp(
            y, self.mesh)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Megatron `VocabParallelEmbedding`: rank r holds rows [r*V/n, (r+1)*V/n) of the table;
    tokens outside that range give zeros, and g (or a reduce-scatter under SP) sums the ranks.
    """

    tp_placements = {"weight": Shard(0)}

    def __init__(self, embedding: nn.Embedding, mesh, *, sequence_parallel: bool = False):
        super().__init__()
        _, size, rank = tp_group(mesh)
        _check_divisible("num_embeddings (vocab)", embedding.num_embeddings, size)
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.rows = embedding.num_embeddings // size
        # a tensor, not an int, so that it can hold a different value per simulated rank
        self.register_buffer("start", torch.zeros((), dtype=torch.long) + rank * self.rows,
                             persistent=False)
        self.weight = _shard(embedding.weight, size, rank, 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.rows)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s) -> (b, s, d)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(y, self.mesh) if self.sequence_parallel else reduce_from_tp(
            y, self.mesh)


# --- whole models ------------------------------------------------------------------------

def _enter_region(mesh, sequence_parallel, reduce_grad):
    """Forward pre-hook: one f (or one all-gather under SP) where the TP region starts."""
    def hook(module, args):
        x = args[0]
        x = all_gather_seq(x, mesh) if sequence_parallel else copy_to_tp(
            x, mesh, reduce_grad=reduce_grad)
        return (x, *args[1:])
    return hook


def parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = False,
                reduce_grad: bool = True) -> nn.Module:
    """The hand-written Megatron path for `tplab.models`: a `(model, mesh) -> model` plan.

    Column-parallel layers enter each region (MLP, SwiGLU, attention) through ONE f, where
    DTensor's ColwiseParallel on q, k and v costs three backward all-reduces. Under sequence
    parallelism the norms (and the row-parallel biases) run on sequence shards, so their
    gradients are partial: a gradient hook all-reduces them (Megatron does this after
    backward, in its `finalize_model_grads`). `reduce_grad=False` removes f's backward
    all-reduce everywhere. On a 2-D (dp, tp) mesh the layers split over tp only.
    """
    sp = sequence_parallel
    col = functools.partial(ColumnParallelLinear, mesh=mesh, copy_input=False)
    row = functools.partial(RowParallelLinear, mesh=mesh, sequence_parallel=sp)
    region = _enter_region(mesh, sp, reduce_grad)
    regions = 0
    for m in list(model.modules()):
        if isinstance(m, models.MLP):
            m.w1, m.w2 = col(m.w1), row(m.w2)
        elif isinstance(m, models.FeedForward):
            m.w1, m.w3, m.w2 = col(m.w1), col(m.w3), row(m.w2)
        elif isinstance(m, models.Attention):
            m.wq, m.wk, m.wv, m.wo = col(m.wq), col(m.wk), col(m.wv), row(m.wo)
        else:
            continue
        m.register_forward_pre_hook(region)
        regions += 1
    if not regions:
        raise PlanError(f"megatron.parallelize knows tplab.models (MLP, FeedForward, Attention, "
                        f"Block, TinyLM), not {type(model).__name__}: build other models from "
                        "ColumnParallelLinear and RowParallelLinear")
    if sp:
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                for p in m.parameters():
                    p.register_hook(functools.partial(all_reduce_grad, mesh=mesh))
    if isinstance(model, models.TinyLM):
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, mesh,
                                                      sequence_parallel=sp)
        model.output = ColumnParallelLinear(model.output, mesh, copy_input=not sp,
                                            gather_output=True, reduce_grad=reduce_grad)
        if sp:
            model.output.register_forward_pre_hook(
                lambda module, args: (all_gather_seq(args[0], mesh),))
    elif sp:
        # a standalone Block (or layer) under SP: whole sequence in and out, sharded inside
        model.register_forward_pre_hook(lambda module, args: (scatter_to_tp(args[0], mesh, 1),),
                                        prepend=True)
        model.register_forward_hook(lambda module, args, out: gather_from_tp(out, mesh, 1))
    return model
