"""The conjugate operators of Megatron-LM's tensor parallelism, as autograd Functions.

Megatron-LM's megatron/core/tensor_parallel/mappings.py (Shoeybi et al. 2019, section 3;
Korthikanti et al. 2022 for the sequence-parallel pair): f, g, scatter, gather, and SP's
all-gather / reduce-scatter on the sequence dim, each with its functional form
(`copy_to_tp(x, mesh)`, ...). The table is in tplab/megatron/__init__.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tplab.errors import PlanError
from tplab.mesh import split, tp_group

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


def check_divisible(what, length, size):
    """A PlanError unless `size` ranks can split `length` evenly (what Megatron asserts)."""
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
        return split(x, size, rank, dim)

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
        return split(grad, size, rank, dim), None, None, None, None


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
    check_divisible(f"dim {dim} of the input", x.shape[dim], size)
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
    check_divisible(f"dim {dim} (sequence)", x.shape[dim], size)
    return ReduceScatterSeq.apply(x, group, size, dim)
