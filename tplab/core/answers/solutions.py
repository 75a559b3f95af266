"""Reference solutions of the exercises, one per name, written as a learner would.

`tplab.exercises.solution(name)` shows the source of the one asked for; the workbooks inject
them (parameter `inject = "solutions"`) to check that the checker passes what is right.
The operators mirror Megatron-LM's megatron/core/tensor_parallel/mappings.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from tplab.core.answers import clipping, qk_norm


class F_(torch.autograd.Function):
    """f (Megatron `_CopyToModelParallelRegion`): identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # every rank already holds the whole x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # never reduce into the tensor autograd handed us
        dist.all_reduce(grad, group=ctx.group)  # dL/dx = sum over ranks of each rank's term
        return grad, None


class G(torch.autograd.Function):
    """g (Megatron `_ReduceFromModelParallelRegion`): all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()  # do not sum into the caller's partial
        dist.all_reduce(y, group=group)  # y = sum over ranks of the partial outputs
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # y = sum_r x_r, so dL/dx_r = dL/dy on every rank


def my_part(t: torch.Tensor, dim: int, n: int, r) -> torch.Tensor:
    """Rank r's chunk of n along dim. index_select, not t.chunk(n)[r]: in tplab.simulate the
    rank r is symbolic (one value per rank), and an index tensor carries every value."""
    size = t.shape[dim] // n
    return t.index_select(dim, torch.arange(size) + r * size)


class ColumnParallel(nn.Module):
    """Megatron `ColumnParallelLinear`: keep rows [r*out/n, (r+1)*out/n) of weight (out, in)."""

    def __init__(self, linear: nn.Linear, mesh):
        super().__init__()
        self.group = mesh.get_group()
        n, r = mesh.size(), mesh.get_local_rank()
        self.weight = nn.Parameter(my_part(linear.weight.detach(), 0, n, r))  # (out/n, in)
        self.bias = nn.Parameter(my_part(linear.bias.detach(), 0, n, r))  # (out/n,)

    def forward(self, x):
        x = F_.apply(x, self.group)  # f: the backward sums dL/dx over the ranks
        return F.linear(x, self.weight, self.bias)  # (b, s, in) -> (b, s, out/n)


class RowParallel(nn.Module):
    """Megatron `RowParallelLinear`: keep columns [r*in/n, (r+1)*in/n) of weight (out, in);
    sum the partial outputs with g, then add the bias once."""

    def __init__(self, linear: nn.Linear, mesh):
        super().__init__()
        self.group = mesh.get_group()
        n, r = mesh.size(), mesh.get_local_rank()
        self.weight = nn.Parameter(my_part(linear.weight.detach(), 1, n, r))  # (out, in/n)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x_r):
        partial = F.linear(x_r, self.weight)  # (b, s, in/n) -> (b, s, out), this rank's term
        return G.apply(partial, self.group) + self.bias  # the bias after the sum: once


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to the *_single names
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_seq(x, group):
    n = dist.get_world_size(group)
    x = x.movedim(1, 0).contiguous()  # (b, s/n, d) -> (s/n, b, d): collectives use dim 0
    out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
    all_gather(out, x, group=group)
    return out.movedim(0, 1)  # (s, b, d) -> (b, s, d)


def _reduce_scatter_seq(x, group):
    n = dist.get_world_size(group)
    x = x.movedim(1, 0).contiguous()  # (b, s, d) -> (s, b, d)
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    reduce_scatter(out, x, group=group)
    return out.movedim(0, 1)  # (s/n, b, d) -> (b, s/n, d)


class GatherSeq(torch.autograd.Function):
    """SP's g-bar (Megatron `_GatherFromSequenceParallelRegion`): all-gather the sequence
    forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterSeq(torch.autograd.Function):
    """SP's g (Megatron `_ReduceScatterToSequenceParallelRegion`): reduce-scatter the
    sequence forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


SP_PAIR = (GatherSeq, ReduceScatterSeq)

MLP_PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}

BLOCK_SP_PLAN = {
    # the block's input and output are whole sequences; inside, norms run on shards
    "": PrepareModuleInputOutput(
        input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_input=True,
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}

# the broken plan of "fix_plan" is BLOCK_SP_PLAN without the two norms' SequenceParallel
FIXED_PLAN = BLOCK_SP_PLAN


def block_counts(world_size: int) -> dict:
    """plans.block() on one Block: g after attention.wo and feed_forward.w2 forward; in the
    backward one all-reduce per ColwiseParallel layer (wq, wk, wv, w1, w3), each its own f."""
    if world_size == 1:
        return {"forward": {}, "backward": {}}
    return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 5}}


def cost_prediction() -> dict:
    """A ring all-reduce of a (1, 4096, 8192) bf16 activation over 8 GPUs of an H100 SXM
    node: each GPU sends 2 (n-1)/n of the tensor; time = NCCL's per-call latency +
    2 (n-1) alpha + bytes sent / bus bandwidth, with the Simple protocol NCCL takes for a
    64 MiB message (tplab.cost.nccl: NCCL 2.21.5 tuning.cc cites the numbers)."""
    nbytes, n = 1 * 4096 * 8192 * 2, 8
    sent = 2 * (n - 1) / n * nbytes
    base, alpha, bandwidth = 8.4e-6, 3.4e-6, 370e9  # ring/Simple per call, per step; busbw
    return {"bytes": sent, "seconds": base + 2 * (n - 1) * alpha + sent / bandwidth}


# "fsdp_placements" (notebook 13): models.Block under fsdp_tp(plans.block()), dp=2 x tp=2
FSDP_PLACEMENTS = {
    "attention.wq.weight": {"dp": "_StridedShard(dim=0, split_factor=2)", "tp": "Shard(0)"},
    "attention.wo.weight": {"dp": "Shard(0)", "tp": "Shard(1)"},
    "attention_norm.weight": {"dp": "Shard(0)"},
}


SOLUTIONS = {
    "f": F_, "g": G, "column_parallel": ColumnParallel, "row_parallel": RowParallel,
    "sp_pair": SP_PAIR, "mlp_plan": MLP_PLAN, "block_sp_plan": BLOCK_SP_PLAN,
    "fix_plan": FIXED_PLAN, "block_counts": block_counts, "cost_prediction": cost_prediction,
    "qk_norm_grad": qk_norm.solution,
    "clip_grad": clipping.clip_tp,
    "fsdp_placements": FSDP_PLACEMENTS,
}
