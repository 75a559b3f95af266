"""Rank side of `tplab.train_check`: the user's training steps on the parallel model, and,
after each step, how far each parameter's local piece is from the reference's.

The notebook sends the single-device run's parameters of every step once (a file in the
lab's private folder for local ranks, else the argument itself); each rank cuts its own
piece out of them (its chunk of a plain shard, `distribute_tensor(..., src_data_rank=None)`
for a DTensor, which makes the local piece of any placement with no communication) and
keeps one number per parameter and step. Only those numbers, the losses, and the copies of
the replicated parameters (for the replica spread) go back: never every parameter of
every step.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import DTensor, distribute_tensor

from tplab import placements
from tplab.layouts import tp_layout
from tplab.mesh import make_mesh, split, tp_group
from tplab.pairing import pair
from tplab.plans import apply_plan
from tplab.pytrees import call_model, leaves, map_tensors
from tplab.rank.grad_step import call_loss, loss_context, replica_slice

LIVE_PREFIX = "\x1b[8m[tplab-train]"  # concealed: an old terminal shows nothing of it
LIVE_SUFFIX = "\x1b[0m"


def default_step(model, optimizer, batch, loss_fn=None):
    """forward, loss (`loss_fn(output, batch)`, as grad_check's; under `loss_parallel()`
    when the logits are vocab-sharded DTensors), backward, `optimizer.step()`,
    `optimizer.zero_grad()`; returns the loss."""
    out = call_model(model, batch)
    with loss_context(out):
        loss = call_loss(loss_fn, out, batch)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def default_optimizer(params):
    """AdamW (torch's defaults but lr=1e-3 and weight_decay=0.01)."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def plain_loss(loss) -> torch.Tensor:
    """The step's loss as a plain 0-d float tensor (a DTensor, an AsyncCollectiveTensor or
    a Python number)."""
    if isinstance(loss, (int, float)):
        return torch.tensor(float(loss))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the training step must return the loss, a scalar tensor; got "
                        f"{type(loss).__name__}"
                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                           else ""))
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if isinstance(loss, AsyncCollectiveTensor):
        loss = loss.wait()
    return loss.detach().reshape(()).float()


def batch_sum(batch) -> torch.Tensor:
    """A checksum of a batch (float64 sum of its tensors): do ranks and notebook agree?"""
    total = torch.zeros((), dtype=torch.float64)
    for _, t in leaves(batch, "batch"):
        total = total + t.detach().double().sum()
    return total


def average_over_dp(model, mesh) -> None:
    """DDP's gradient all-reduce, as hooks: each gradient averaged over the dp replicas as
    soon as backward has accumulated it (before the user's clipping and optimizer step)."""
    group, dp = mesh.get_group("dp"), mesh["dp"].size()

    def hook(p):
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=group)
        g.div_(dp)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)


def expected_local(ref: torch.Tensor, info: dict, param, mesh) -> torch.Tensor:
    """This rank's piece of the reference tensor `ref`, laid out as the ranks' parameter."""
    if isinstance(param, DTensor):
        return distribute_tensor(ref, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    dim = placements.shard_dim(info["placement"])
    if dim is None:
        return ref
    _, size, rank = tp_group(mesh)
    if info["padded"]:
        pad = [0, 0] * (ref.ndim - dim - 1) + [0, info["padded"] - ref.shape[dim]]
        ref = torch.nn.functional.pad(ref, pad)
    return split(ref, size, rank, dim)


def emit_live(step: int, loss, diffs: dict[str, torch.Tensor], rank: int) -> None:
    """One line per step for the notebook's live figure (see tplab/training/live.py)."""
    record = {"rank": rank, "step": step, "loss": float(loss),
              "diff": max((float(d) for d in diffs.values()), default=0.0)}
    sys.stdout.write(f"{LIVE_PREFIX}{json.dumps(record)}{LIVE_SUFFIX}\n")
    sys.stdout.flush()


def train_on_ranks(build_model, state, plan, make_batch, steps, step, make_optimizer, loss_fn,
                   dp, reference, param_map, ref_info, live):
    """Rank side: build, load the notebook's weights, parallelise, then `steps` of the
    user's step; see the module doc. Returns losses, batch checksums, per-step parameter
    differences (by the ranks' parameter names) and the replicated parameters' copies."""
    world = dist.get_world_size()
    mesh = make_mesh(tp=world) if dp == 1 else make_mesh(dp=dp, tp=world // dp)
    tp = world // dp
    if isinstance(reference, str):
        reference = torch.load(reference, mmap=True, weights_only=True)
    model = build_model()
    model.load_state_dict(state)
    per_rank_parameters(model)
    model = apply_plan(model, mesh, plan) if isinstance(plan, dict) else plan(model, mesh)
    if dp > 1:
        average_over_dp(model, mesh)
    optimizer = (make_optimizer or default_optimizer)(model.parameters())
    layout = tp_layout(model, of="param")
    described = {n: {k: v for k, v in i.items() if k != "value"} for n, i in layout.items()}
    pairs, lone_ranks, lone_ref, problems = pair(ref_info["shapes"], described, tp, param_map,
                                                 ref_info["aliases"])
    params = dict(model.named_parameters())
    kept = [p for p in pairs if p["placement"] != placements.MESH]
    if len(kept) < len(pairs):
        raise TypeError("train_check compares parameters laid out on the tp dim; FSDP2 "
                        "(fully_shard) parameters on the whole mesh are not supported")
    copies = [p["ranks"] for p in kept if dp > 1 or not (p["placement"] or "").startswith(
        ("Shard", "Partial"))]

    def measure():
        diffs = {}
        for p in kept:
            local = layout_value(params[p["ranks"]])
            want = expected_local(reference[p["ref"]][len(losses)], p, params[p["ranks"]], mesh)
            diffs[p["ranks"]] = (local.float() - want.float()).abs().max() if local.numel() \
                else torch.zeros(())
        for name in copies:
            replicas[name].append(layout_value(params[name]).clone())
        return diffs

    losses: list[torch.Tensor] = []
    replicas: dict[str, list[torch.Tensor]] = {name: [] for name in copies}
    diffs = [measure()]
    sums = []
    user_step = step or (lambda m, o, b: default_step(m, o, b, loss_fn))
    rank = dist.get_rank() if live else 0
    for i in range(steps):
        batch = make_batch(i)
        sums.append(batch_sum(batch))
        if dp > 1:
            batch = map_tensors(lambda t: replica_slice(t, mesh), batch)
        losses.append(plain_loss(user_step(model, optimizer, batch)))
        diffs.append(measure())
        if live:
            emit_live(i + 1, losses[-1], diffs[-1], rank)
    names = [p["ranks"] for p in kept]
    return {"pairs": kept, "lone_ranks": lone_ranks, "lone_ref": lone_ref, "problems": problems,
            "layout": {n: described[n] for n in names},
            "losses": torch.stack(losses) if losses else torch.zeros(0),
            "batch_sums": torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64),
            "diffs": torch.stack([torch.stack([d[n] for n in names]) if names
                                  else torch.zeros(0) for d in diffs]),
            "replicas": {n: torch.stack(v) for n, v in replicas.items()}}


def per_rank_parameters(model) -> None:
    """In `tplab.simulate` only: make every parameter hold one value per simulated rank.

    A model built with rank-dependent randomness off (tplab.models builds so) has plain
    tensors as parameters; an optimizer's in-place update of a plain tensor under
    LocalTensorMode is applied once per simulated rank to the same storage (measured here:
    AdamW's first step moved every weight by 0.66 lr, not lr). Ties are kept."""
    if enabled_local_tensor_mode() is None:
        return
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                local = torch.zeros(p.shape, dtype=p.dtype) + p.detach()  # a LocalTensor
                made[id(p)] = torch.nn.Parameter(local, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]


def layout_value(p) -> torch.Tensor:
    """A parameter's local piece (a DTensor's local tensor), detached."""
    return (p.to_local() if isinstance(p, DTensor) else p).detach()
