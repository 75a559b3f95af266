"""Rank side of `tplab.grad_check` (tplab/checks/grad.py): the step every rank runs.

`parallel_step` builds the model, loads the notebook's reference weights, parallelises it
with the plan, runs one forward and backward, and returns what the notebook compares:
outputs, the loss, input gradients and every parameter's gradient with its layout
(`tplab.layouts.tp_layout`). With dp > 1 (a (dp, tp) mesh) each replica takes its slice of
the batch and averages its parameter gradients over dp, as DDP does.

The loss is shared with the notebook's single-device reference: `call_loss` and
`loss_context` run on both sides (and in `tplab.train_check`'s steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from tplab.core import placements
from tplab.core.fsdp_layout import refuse_in_simulation
from tplab.core.pytrees import call_model, leaves, map_tensors
from tplab.errors import LabError
from tplab.layouts import ParamLayout, tp_layout
from tplab.mesh import make_mesh
from tplab.plans import parallelizer

__all__ = ["StepResult", "call_loss", "loss_context", "parallel_step", "replica_slice",
           "with_grad"]


@dataclasses.dataclass(frozen=True, eq=False)
class StepResult:
    """What one rank's `parallel_step` hands the notebook (by pickle, so both sides know
    the class): output leaves and input gradients by pytree path ("output.logits",
    "input[0]"), the loss, and every parameter's gradient with its layout. With dp > 1 the
    outputs, input gradients and loss are DTensors on the whole (dp, tp) mesh (LocalShards
    in the notebook)."""

    outputs: dict[str, object]
    loss: object
    input_grads: dict[str, object]
    params: dict[str, ParamLayout]


def call_loss(loss_fn, out, x) -> torch.Tensor:
    """`loss_fn(out, x)` (or `loss_fn(out)`: by its signature), or the default loss; a
    LabError naming loss_fn when it gives anything but a scalar tensor (backward needs one:
    `torch.autograd.backward` of a non-scalar asks for grad_tensors)."""
    loss = _call_loss(loss_fn, out, x)
    name = getattr(loss_fn, "__name__", repr(loss_fn))
    if not isinstance(loss, torch.Tensor):
        raise LabError(f"loss_fn {name} returned {type(loss).__name__} {loss!r}; it must "
                       "return a scalar tensor (such as out.sum())")
    if loss.numel() != 1:
        raise LabError(f"loss_fn {name} returned a tensor of shape {tuple(loss.shape)}; it "
                       "must return a scalar (reduce it: .sum() or .mean())")
    return loss


def _call_loss(loss_fn, out, x):
    if loss_fn is None:
        parts = [t.pow(2).sum() for _, t in leaves(out) if t.is_floating_point()]
        if not parts:
            raise LabError("grad_check: the output has no floating-point tensor for the "
                           "default loss 0.5 * sum(output**2); pass loss_fn=")
        return 0.5 * sum(parts[1:], parts[0])
    try:
        params = inspect.signature(loss_fn).parameters.values()
        two = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2
        two = two or any(p.kind is p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        two = True
    return loss_fn(out, x) if two else loss_fn(out)


def loss_context(out):
    """`loss_parallel()` when an output is a DTensor sharded on its last dim, else nothing."""
    for _, t in leaves(out):
        if isinstance(t, DTensor) and any(
                p.is_shard() and p.dim in (-1, t.ndim - 1) for p in t.placements):
            return loss_parallel()
    return contextlib.nullcontext()


def with_grad(x):
    """A copy of the input pytree whose floating-point tensors require grad (so their
    gradients are checked too; integer token ids stay as they are)."""
    return map_tensors(lambda t: t.clone().requires_grad_(t.is_floating_point())
                       if t.is_floating_point() else t.clone(), x)


def parallel_step(build_model, state, plan, x, loss_fn, dp=1, average_dp=True):
    """Build, load the reference weights, parallelise, one forward and backward. With
    dp > 1 on a (dp, tp) mesh: this replica's slice of the batch (see tplab/checks/grad.py)."""
    world = dist.get_world_size()
    mesh = make_mesh(tp=world) if dp == 1 else make_mesh(dp=dp, tp=world // dp)
    model = build_model()
    model.load_state_dict(state)
    model = parallelizer(plan)(model, mesh)
    refuse_in_simulation(model)
    if dp > 1:
        x = map_tensors(lambda t: replica_slice(t, mesh), x)
    x = with_grad(x)
    out = call_model(model, x)  # may hold AsyncCollectiveTensors: .wait() would cut the graph
    with loss_context(out):
        loss = call_loss(loss_fn, out, x)
        loss.backward()
    params = tp_layout(model)
    outs = dict(leaves(out, "output"))
    grads = {k: t.grad for k, t in leaves(x, "input") if t.is_floating_point()}
    if dp == 1:
        return StepResult(outs, loss.detach(), grads, params)
    return _on_whole_mesh(mesh, outs, loss, grads, params, average_dp)


def replica_slice(x, mesh):
    """dp replica d's slice d of the batch (dim 0). index_select with a tensor index, not
    chunk: in tplab.simulate the dp coordinate holds every rank's value."""
    dp = mesh["dp"].size()
    n = x.shape[0] // dp
    return x.index_select(0, torch.arange(n, device=x.device) + mesh.get_local_rank("dp") * n)


def _on_whole_mesh(mesh, outs, loss, grads, params, average_dp):
    """dp > 1: outputs and input grads as DTensors on the whole (dp, tp) mesh, Shard(0)
    over dp, so that the notebook places them; the loss Partial over dp (each replica holds
    loss_d / dp of the mean); parameter gradients averaged over dp (DDP), but not those FSDP2
    manages (already reduce-scattered and averaged over dp)."""
    dp = mesh["dp"].size()

    def whole(t, over_dp):
        if t is None:
            return None
        tp_placement = Replicate()
        if isinstance(t, DTensor):  # on the tp sub-mesh: one placement
            tp_placement, t = t.placements[-1], t.to_local()
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
        t = t.detach()
        if isinstance(tp_placement, Shard) and tp_placement.dim < 0:
            tp_placement = Shard(tp_placement.dim + t.ndim)
        return DTensor.from_local(t, mesh, [over_dp, tp_placement], run_check=False)

    averaged = dict(params)
    for name, info in params.items():
        g = info.value
        if g is not None and info.placement != placements.MESH and average_dp and \
                not info.fsdp:
            g = g.detach().clone()
            dist.all_reduce(g, group=mesh.get_group("dp"))
            averaged[name] = dataclasses.replace(info, value=g / dp)
    return StepResult({k: whole(v, Shard(0)) for k, v in outs.items()},
                      whole(loss / dp, Partial()),
                      {k: whole(None if g is None else g / dp, Shard(0))
                       for k, g in grads.items()}, averaged)
