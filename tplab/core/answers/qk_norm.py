"""The exercise "qk_norm_grad"'s answers (notebook 11): the reference and two typical
mistakes, hooks on a replicated q_norm weight's gradient. Both sides: the notebook hands them
to the ranks (tplab/rank/qk_norm_step.py), which run them."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["average_it", "leave_it", "solution"]


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
