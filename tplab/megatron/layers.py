"""Megatron-LM's parallel layers, and the hand-written Megatron path for `tplab.models`.

megatron/core/tensor_parallel/layers.py: ColumnParallelLinear, RowParallelLinear and
VocabParallelEmbedding, each built from a full layer and the operators of
tplab/megatron/operators.py (Shoeybi et al. 2019, section 3); `parallelize` turns a
tplab model into them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tplab import models
from tplab.errors import PlanError
from tplab.megatron.operators import (
    all_gather_seq,
    all_reduce_grad,
    check_divisible,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_to_tp,
)
from tplab.mesh import split, tp_group

# --- parallel layers ---------------------------------------------------------------------

def _shard(t: torch.Tensor | None, size: int, rank, dim: int):
    if t is None:
        return None
    return nn.Parameter(split(t.detach(), size, rank, dim).clone())


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
        check_divisible("out_features", linear.out_features, size)
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
        check_divisible("in_features", linear.in_features, size)
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
        check_divisible("num_embeddings (vocab)", embedding.num_embeddings, size)
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
