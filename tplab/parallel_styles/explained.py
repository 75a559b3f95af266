"""f and g that carry their reason (Shoeybi et al. 2019, section 3): `copy_with_cause` and
`reduce_with_cause`, for tplab's styles and a style of one's own, each collective shown by
`tplab.trace` with its style's `why`. torch alone: every style module builds on it."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _ExplainedCopy(torch.autograd.Function):
    """f with the style's reason attached (`ctx.tp_cause`, shown by tplab.trace): identity
    forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group, cause):
        ctx.group, ctx.tp_cause = group, cause
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _ExplainedReduce(torch.autograd.Function):
    """g with the style's reason attached: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, cause):
        ctx.tp_cause = cause
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_with_cause(x: torch.Tensor, group, why: str) -> torch.Tensor:
    """f, whose backward all-reduce the trace shows with `why` as its cause (a style of
    one's own passes its spec's reason)."""
    return _ExplainedCopy.apply(x, group, why)


def reduce_with_cause(x: torch.Tensor, group, why: str) -> torch.Tensor:
    """g, whose forward all-reduce the trace shows with `why` as its cause."""
    return _ExplainedReduce.apply(x, group, why)
