"""Rank side of the doctor's smoke test (tplab/checks/smoke.py): an all-reduce, and one
traced Megatron MLP step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tplab import megatron, models
from tplab.mesh import make_mesh
from tplab.tracing import trace


def mlp_step(cfg):
    """One traced Megatron MLP step."""
    model = megatron.parallelize(models.MLP(cfg), make_mesh())
    x = models.make_input(cfg).requires_grad_()
    with trace() as t:
        model(x).pow(2).sum().backward()
    return {"counts": t.counts(), "finite": bool(torch.isfinite(x.grad).all())}


def all_reduce_ranks():
    """An all-reduce of (rank + 1) over every rank: each gets the sum."""
    x = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    return x.tolist()
