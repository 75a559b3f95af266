"""Typical wrong answers, each with a phrase its feedback must contain.

The tests run every one of them (tests/test_exercises.py); the workbooks inject the first of
each exercise (parameter `inject = "mistakes"`) and assert that it fails with its message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tplab.core.answers import clipping, qk_norm
from tplab.core.answers import solutions as ok


class FNoReduce(torch.autograd.Function):
    """f whose backward forgets the all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FForwardReduce(torch.autograd.Function):
    """An all-reduce in the forward, where none belongs (that is g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FInPlace(torch.autograd.Function):
    """Reduces into the incoming gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FSomeRanks(torch.autograd.Function):
    """The all-reduce on rank 0 only: the other ranks never join it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if dist.get_rank(ctx.group) == 0:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FWrongShape(torch.autograd.Function):
    """Returns a gradient of the wrong shape."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.sum(0)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FRaises(torch.autograd.Function):
    """A typo: an exception in the forward."""

    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(y)  # noqa: F821  (the typo)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GNoReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GBackwardReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GInPlace(torch.autograd.Function):
    """Sums into the caller's partial."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnNoF(ok.ColumnParallel):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ColumnGathered(ok.ColumnParallel):
    """Gathers its output: right values, wrong shape for a column-parallel layer."""

    def forward(self, x):
        y = super().forward(x)
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class RowBiasEveryRank(ok.RowParallel):
    def forward(self, x_r):
        return ok.G.apply(F.linear(x_r, self.weight, self.bias), self.group)


class RowNoG(ok.RowParallel):
    def forward(self, x_r):
        return F.linear(x_r, self.weight) + self.bias


class GatherSplitBackward(ok.GatherSeq):
    """Backward keeps this rank's chunk instead of reduce-scattering: the sum is missing."""

    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return ok.my_part(grad, 1, n, r), None


class ScatterByAllReduce(torch.autograd.Function):
    """Right values, but an all-reduce and a chunk: twice the bytes of a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return ok.my_part(y, 1, n, r)

    @staticmethod
    def backward(ctx, grad):
        return ok.GatherSeq.forward(ctx, grad, ctx.group), None


class Square(nn.Module):
    """Not a parallel linear at all: weight kept whole."""

    def __init__(self, linear, mesh):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _no_norms(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if not k.endswith("norm")}


BROKEN_PLAN = _no_norms(ok.BLOCK_SP_PLAN)
NO_SP_PLAN = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
              "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
              "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
              "feed_forward.w2": RowwiseParallel()}

# name -> [(what the learner did, the answer, a phrase the feedback must contain)]
MISTAKES = {
    "f": [("no all-reduce in backward", FNoReduce, "each rank's own term"),
          ("an all-reduce in forward", FForwardReduce, "the all-reduce belongs in its backward"),
          ("reduce into the incoming gradient", FInPlace, "in place"),
          ("a gradient of the wrong shape", FWrongShape, "raised an exception"),
          ("an exception", FRaises, "NameError"),
          ("a collective on rank 0 only", FSomeRanks, "not every rank reaches")],
    "g": [("no all-reduce in forward", GNoReduce, "this rank's partial"),
          ("an all-reduce in backward", GBackwardReduce, "too large"),
          ("sum into the input", GInPlace, "in place")],
    "column_parallel": [("no f", ColumnNoF, "apply f to x first"),
                        ("gathered output", ColumnGathered, "keeps this rank's"),
                        ("the whole weight", Square, "has shape")],
    "row_parallel": [("bias on every rank", RowBiasEveryRank, "x bias"),
                     ("no g", RowNoG, "partial sum")],
    "sp_pair": [("split instead of reduce-scatter backward", (GatherSplitBackward,
                                                              ok.ReduceScatterSeq),
                 "GatherSeq's backward"),
                ("all-reduce and chunk", (ok.GatherSeq, ScatterByAllReduce), "all_reduce")],
    "mlp_plan": [("outputs gathered", {"w1": ColwiseParallel(output_layouts=Replicate()),
                                       "w2": ColwiseParallel(output_layouts=Replicate())},
                  "reference plan issues"),
                 ("a typo in a module name", {"w1": ColwiseParallel(), "w_2": RowwiseParallel()},
                  "w_2")],
    "block_sp_plan": [("no sequence parallelism", NO_SP_PLAN, "no sequence parallelism")],
    "fix_plan": [("the broken plan as it is", BROKEN_PLAN, "norm.weight")],
    "block_counts": [("Megatron's counts", {"forward": {"all_reduce": 2},
                                            "backward": {"all_reduce": 2}}, "backward")],
    "cost_prediction": [("the tensor's bytes", {"bytes": 4096 * 8192 * 2, "seconds": 1e-4},
                         "bytes")],
    "qk_norm_grad": [("the gradient left as it is", qk_norm.leave_it, "only its own heads"),
                     ("the gradient averaged", qk_norm.average_it, "an average")],
    "clip_grad": [("torch's clip_grad_norm_", clipping.clip_per_rank, "its own norm"),
                  ("replicas counted per rank", clipping.clip_counts_replicas, "counted once"),
                  ("no clipping", clipping.no_clip, "not with one device"),
                  ("every gradient halved", clipping.halve, "not with one device"),
                  ("max_norm ignored", clipping.ignore_max_norm, "not with one device"),
                  ("no norm returned", clipping.returns_none, "must return the total norm")],
    "fsdp_placements": [("FSDP2's shard taken as plain Shard(0)", {
        "attention.wq.weight": {"dp": "Shard(0)", "tp": "Shard(0)"},
        "attention.wo.weight": {"dp": "Shard(0)", "tp": "Shard(1)"},
        "attention_norm.weight": {"dp": "Shard(0)"}}, "strided shard")],
}
