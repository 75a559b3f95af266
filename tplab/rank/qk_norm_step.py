"""Rank side of the exercise "qk_norm_grad" (tplab/exercises/qk_norm.py): Qwen3's q_norm, a
replicated RMSNorm weight applied to this rank's query heads, with the learner's gradient
hook on the weight. Returns plain data; the notebook side judges. The reference answer and
two typical mistakes: tplab/core/answers/qk_norm.py (both sides)."""

from __future__ import annotations

import torch
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
