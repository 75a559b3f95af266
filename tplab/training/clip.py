"""Gradient clipping under tensor parallelism, for hand-written models whose parameters are
plain local shards (tplab.megatron, or your own Megatron-style layers).

`torch.nn.utils.clip_grad_norm_` on such a model computes each rank's norm from the pieces
it holds: the sharded gradients are only a part of the whole, so every rank gets a
different norm, scales its gradients by a different factor, and the replicated weights
(norms, biases after a row-parallel sum) drift apart while the sharded ones are scaled
wrongly. Megatron-LM (megatron/core/optimizer/clip_grads.py, `get_grad_norm_fp32`)
adds the squared norms of the sharded gradients over the model-parallel group with an
all-reduce and counts each replicated parameter once (on tp rank 0 only,
`param_is_not_tensor_parallel_duplicate`); every rank then clips by the same factor.

DTensor plans need none of this: a DTensor gradient knows its placements, so
`torch.nn.utils.clip_grad_norm_` computes its norm as a DTensor op, which reduces the
sharded pieces over the mesh and takes a Replicate() gradient once; the total norm comes
out the same on every rank. That holds when every parameter is a DTensor (a sequence-
parallel plan makes the norms DTensors too; torchtitan's FSDP2 makes every one); a plan
that leaves some parameters plain (a norm outside a plain TP plan) makes torch's
clip_grad_norm_ fail on "mixed torch.Tensor and DTensor". `clip_grad_norm` below takes
both kinds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tplab.core import placements
from tplab.layouts import tp_layout
from tplab.mesh import tp_group


def find_mesh(model: torch.nn.Module):
    """The mesh a parallel model was split over: a DTensor parameter's, or a hand-written
    layer's `mesh` attribute (tplab.megatron's); None for a model on one device."""
    for p in model.parameters():
        # not FSDP2's 1-D dp mesh over hand-written TP pieces: the layers' own mesh below
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ("tp",)):
            return p.device_mesh
    for m in model.modules():
        if getattr(m, "tp_placements", None) and getattr(m, "mesh", None) is not None:
            return m.mesh
    return None


def grad_norm(model: torch.nn.Module, mesh=None, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the WHOLE model's gradient, the same on every tp rank: the sharded
    gradients' squared norms all-reduced over the tp group, the replicated ones counted once.

    A parameter's layout comes from `tplab.layouts.tp_layout` (a DTensor's placements, or
    a hand-written module's `tp_placements`); a plain parameter with neither is taken as a
    replica: declare `tp_placements` on your module for the shards it holds.
    """
    if norm_type != 2.0:
        raise ValueError(f"grad_norm: only the 2-norm is implemented (Megatron's default), "
                         f"got norm_type={norm_type!r}")
    mesh = find_mesh(model) if mesh is None else mesh
    sharded = torch.zeros((), dtype=torch.float32)
    replicated = torch.zeros((), dtype=torch.float32)
    whole = torch.zeros((), dtype=torch.float32)  # DTensor gradients, already reduced
    for name, info in tp_layout(model, of="grad").items():
        g = info.value
        if g is None:
            continue
        grad = model.get_parameter(name).grad
        if isinstance(grad, DTensor) and info.dp_placement is None:
            # a DTensor op: Shard pieces summed over the mesh, a Partial(sum) gradient reduced
            # before it is squared, a Replicate one taken once (FSDP2 x TP on the whole
            # (dp, tp) mesh too). FSDP2's shards of a hand-written TP piece are not: their
            # piece (`info.value`, gathered over dp) counts as the TP layout says, below
            whole = whole + grad.detach().float().pow(2).sum().full_tensor()
            continue
        square = g.detach().float().pow(2).sum()
        if placements.is_shard(info.placement):
            sharded = sharded + square
        else:
            replicated = replicated + square
    if mesh is not None:
        sharded = sharded.clone()
        dist.all_reduce(sharded, group=tp_group(mesh)[0])
    return (sharded + replicated + whole).sqrt()


def clip_grad_norm(model: torch.nn.Module, max_norm: float, mesh=None,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Megatron-LM's TP-aware clipping: scale every gradient of `model` by
    min(1, max_norm / (total norm + 1e-6)), with the total norm of `grad_norm` (the whole
    model's, the same on every rank; `mesh=None`: the model's own). Returns the total
    norm, as torch's `clip_grad_norm_` does. The module doc says why `clip_grad_norm_` is
    wrong here."""
    if not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a positive number, got {max_norm!r}")
    total = grad_norm(model, mesh, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.dtype))
    return total
