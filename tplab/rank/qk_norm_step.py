"""Rank side of the exercise "qk_norm_grad" (tplab/exercises/qk_norm.py): Qwen3's q_norm, a
replicated RMSNorm weight applied to this rank's query heads, with the learner's gradient
hook on the weight. Returns plain data; the notebook side judges. The reference answer and
two typical mistakes live here too: answers run on the ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tplab import megatron, tracing
from tplab.mesh import make_mesh


def qk_norm_step(answer, q: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> dict:
    """q: (batch, seq, heads, head_dim), the same on every rank; this rank keeps its heads
    (the colwise q_proj's output), normalises them with a replicated weight whose gradient
    goes through `answer(grad, group)`, and backpropagates its heads' part of dy."""
    mesh = make_mesh()
    group = mesh.get_group()
    mine = megatron.scatter_to_tp(q, mesh, dim=2).detach()       # (b, s, heads/N, hd)
    my_dy = megatron.scatter_to_tp(dy, mesh, dim=2).detach()
    w = torch.nn.Parameter(weight.detach().clone())
    w.register_hook(lambda grad: answer(grad, group))
    with tracing.trace() as t:
        y = F.rms_norm(mine, (mine.shape[-1],), w, eps=1e-6)      # q_norm: over head_dim
        y.backward(my_dy)
    return {"grad": None if w.grad is None else w.grad.detach(), "counts": t.counts()}


def solution(grad, group):
    """Each rank's gradient covers its own heads only: sum the ranks' terms."""
    grad = grad.clone()                      # never reduce into autograd's tensor
    dist.all_reduce(grad, group=group)       # dL/dw = sum over all heads = over the ranks
    return grad


def leave_it(grad, group):
    """The mistake: a replicated weight, as if its gradient were whole already."""
    return grad


def average_it(grad, group):
    """The mistake: an average, as data parallelism's gradients are."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad / dist.get_world_size(group)
