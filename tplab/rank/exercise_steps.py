"""Rank side of the exercises: run a learner's answer on every rank, traced, and bring back
what the checker compares with the single-device reference (tplab/exercises/checks.py).

Each step returns plain data (tensors, dicts of counts); it never judges. Every tensor the
learner's code receives is built here from arguments the notebook sent, identically on
every rank, so the reference on the notebook side sees the same numbers.
"""

from __future__ import annotations

import torch

from tplab import megatron, plans, tracing
from tplab.mesh import make_mesh


def _mine(stacked: torch.Tensor, mesh) -> torch.Tensor:
    """Row `rank` of a (N, ...) tensor: this rank's own copy (works in tplab.simulate too)."""
    return megatron.scatter_to_tp(stacked, mesh, dim=0).squeeze(0)


def _watch_grad(y: torch.Tensor) -> dict:
    """A hook on y that keeps the gradient autograd hands to the answer's backward, and a
    copy of it: after backward, a difference means the backward edited it in place."""
    seen: dict = {}

    def keep(grad):
        seen["grad"], seen["copy"] = grad, grad.detach().clone()

    y.register_hook(keep)
    return seen


def _edited(seen: dict) -> torch.Tensor:
    """How much the gradient changed (a tensor: in tplab.simulate it holds every rank's)."""
    if "grad" not in seen:
        return torch.zeros(())
    return (seen["grad"].detach() - seen["copy"]).abs().max()


def _output(y, what: str):
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{what} returned {type(y).__name__}, not a tensor")
    return y


def conjugate_step(Answer, x: torch.Tensor, weights: torch.Tensor, partial: bool) -> dict:
    """f or g: y = Answer.apply(x_in, group) and loss = sum(y * w_r), w_r this rank's own
    weights, so that dL/dy differs per rank. `partial`: x_in is this rank's row of x (g's
    input: a partial sum), else x itself (f's input: the same on every rank)."""
    mesh = make_mesh()
    x_in = (_mine(x, mesh) if partial else x).detach().clone().requires_grad_()
    before = x_in.detach().clone()
    w = _mine(weights, mesh)
    with tracing.trace() as t:
        y = _output(Answer.apply(x_in, mesh.get_group()), "Answer.apply(x, group)")
        seen = _watch_grad(y) if y.requires_grad else {}
        if y.requires_grad:
            (y * w).sum().backward()
    return {"y": y.detach(), "dx": None if x_in.grad is None else x_in.grad.detach(),
            "requires_grad": y.requires_grad, "counts": t.counts(),
            "input_edited": (x_in.detach() - before).abs().max(),
            "grad_edited": _edited(seen)}


def linear_step(Answer, linear: torch.nn.Linear, x: torch.Tensor, shard_input: bool) -> dict:
    """A parallel linear: model = Answer(linear, mesh); y = model(x_in); loss = ½ Σ y².
    `shard_input`: x_in is this rank's features of x (a row-parallel linear's input)."""
    mesh = make_mesh()
    if shard_input:
        x_in = megatron.scatter_to_tp(x, mesh).detach().clone().requires_grad_()
    else:
        x_in = x.detach().clone().requires_grad_()
    model = Answer(linear, mesh)
    with tracing.trace() as t:
        y = _output(model(x_in), "your module's forward")
        if y.requires_grad:
            (0.5 * y.pow(2).sum()).backward()
    return {"y": y.detach(), "dx": None if x_in.grad is None else x_in.grad.detach(),
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.detach()
                      for n, p in model.named_parameters()},
            "counts": t.counts(), "records": [(r["phase"], r["op"]) for r in t.records]}


def sequence_step(Gather, ReduceScatter, x: torch.Tensor, w_gather: torch.Tensor,
                  partial: torch.Tensor, w_scatter: torch.Tensor) -> dict:
    """The sequence-parallel pair, each on its own: Gather.apply(x_r, group) with x_r this
    rank's sequence shard of x; ReduceScatter.apply(p_r, group) with p_r this rank's
    partial sum. Losses weighted per rank, so every gradient is a sum over ranks."""
    mesh = make_mesh()
    group = mesh.get_group()
    out: dict = {}
    x_r = megatron.scatter_to_tp(x, mesh, dim=1).detach().clone().requires_grad_()
    with tracing.trace() as t:
        y = _output(Gather.apply(x_r, group), "Gather.apply(x, group)")
        seen = _watch_grad(y) if y.requires_grad else {}
        if y.requires_grad:
            (y * _mine(w_gather, mesh)).sum().backward()
    out["gather"] = {"y": y.detach(), "dx": None if x_r.grad is None else x_r.grad.detach(),
                     "counts": t.counts(), "grad_edited": _edited(seen)}
    p_r = _mine(partial, mesh).detach().clone().requires_grad_()
    with tracing.trace() as t:
        z = _output(ReduceScatter.apply(p_r, group), "ReduceScatter.apply(x, group)")
        seen = _watch_grad(z) if z.requires_grad else {}
        if z.requires_grad:
            (z * _mine(w_scatter, mesh)).sum().backward()
    out["scatter"] = {"y": z.detach(), "dx": None if p_r.grad is None else p_r.grad.detach(),
                      "counts": t.counts(), "grad_edited": _edited(seen)}
    return out


def plan_counts(build_model, plan, make_input) -> dict:
    """Collective counts and the modules that issue them, for one traced step of
    build_model() under `plan` (a dict, or a callable (model, mesh) -> model)."""
    mesh = make_mesh()
    model = build_model()
    model = plans.parallelizer(plan)(model, mesh)
    x = make_input()
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    with tracing.trace() as t:
        out = model(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.float().pow(2).mean().backward()
    return {"counts": t.counts(),
            "records": [(r["phase"], r["op"], r["module"]) for r in t.records]}
