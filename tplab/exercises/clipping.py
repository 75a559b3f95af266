"""Exercise "clip_grad" (lesson 12), rank side: the reference solution and typical mistakes.

The answer is `clip(model, max_norm) -> total norm` for a hand-written TP model whose
parameters are plain local shards (tplab.megatron's layers declare which in
`tp_placements`), run inside `tplab.training.steps.lm_step` on one device and on the ranks.
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
