"""Exercise "clip_grad" (lesson 12): the reference solution and typical mistakes (both sides:
they run on the ranks; the notebook shows them).

The answer is `clip(model, max_norm) -> total norm` for a hand-written TP model whose
parameters are plain local shards (tplab.megatron's layers declare which in
`tp_placements`), run inside `tplab.training.steps.lm_step` on the ranks only: `judged`
clips the one-device reference with torch's own `clip_grad_norm_` on the whole tensors, so
the answer is judged against the right clipping, never against itself (a no-op, or any
scaling done alike on one device and on the ranks, would pass that), and the answer's code
never runs in the notebook's process, outside the ranks' time limit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _pieces(model):
    """(sharded gradients, replicated gradients, the tp group or None on one device)."""
    sharded, replicated, group = [], [], None
    for module in model.modules():
        placements = getattr(module, "tp_placements", {})
        if placements and getattr(module, "mesh", None) is not None:
            group = module.mesh.get_group("tp") if module.mesh.ndim > 1 else \
                module.mesh.get_group()
        for name, p in module.named_parameters(recurse=False):
            if p.grad is None:
                continue
            placement = placements.get(name)
            is_shard = placement is not None and placement.is_shard()
            (sharded if is_shard else replicated).append(p.grad)
    return sharded, replicated, group


def is_split(model) -> bool:
    """Whether `model` was split by tplab.megatron (its layers hold a mesh), not the whole
    one-device reference."""
    return any(getattr(m, "mesh", None) is not None for m in model.modules())


def judged(model, max_norm: float, answer) -> torch.Tensor:
    """The clipping the check runs: torch's `clip_grad_norm_` on the whole one-device model
    (the truth), the learner's `answer` on the ranks' split model; the answer must return
    the total norm."""
    if not is_split(model):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    total = answer(model, max_norm)
    if isinstance(total, bool) or not isinstance(total, (torch.Tensor, float, int)):
        raise TypeError(f"clip(model, max_norm) must return the total norm (a tensor or a "
                        f"float), not {type(total).__name__}")
    return total


def clip_tp(model, max_norm: float) -> torch.Tensor:
    """Megatron's clipping: squared norms of the sharded gradients summed over the tp group,
    the replicated ones added once; every rank scales by the same factor."""
    sharded, replicated, group = _pieces(model)
    square = sum((g.pow(2).sum() for g in sharded), torch.zeros(()))
    if group is not None:
        dist.all_reduce(square, group=group)
    total = (square + sum((g.pow(2).sum() for g in replicated), torch.zeros(()))).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef)
    return total


def clip_per_rank(model, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ on plain shards: each rank's own norm."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def clip_counts_replicas(model, max_norm: float) -> torch.Tensor:
    """Every squared norm all-reduced: the replicated gradients count tp times."""
    sharded, replicated, group = _pieces(model)
    square = sum((g.pow(2).sum() for g in sharded + replicated), torch.zeros(()))
    if group is not None:
        dist.all_reduce(square, group=group)
    total = square.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef)
    return total


def no_clip(model, max_norm: float) -> torch.Tensor:
    """The mistake: the norm computed and returned, no gradient scaled."""
    return clip_tp(model, float("inf"))


def halve(model, max_norm: float) -> torch.Tensor:
    """The mistake: every gradient halved, whatever the norm."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)
    return torch.zeros(())


def ignore_max_norm(model, max_norm: float) -> torch.Tensor:
    """The mistake: clipped to a norm of 1, not to max_norm."""
    return clip_tp(model, 1.0)


def returns_none(model, max_norm: float) -> None:
    """The mistake: the right clipping, and no total norm returned."""
    clip_tp(model, max_norm)
