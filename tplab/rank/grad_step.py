"""Rank side of `tplab.grad_check` (tplab/checks/grad.py): the step every rank runs.

`parallel_step(job)` builds the model, loads the notebook's reference weights, parallelises
it with the plan, runs one forward and backward (inside `job.context()` when given), and
returns what the notebook compares: outputs, the loss, input gradients and every
parameter's gradient with its layout (`tplab.layouts.tp_layout`). With dp > 1 (a (dp, tp)
mesh) each replica takes its slice of the batch and averages its parameter gradients over
dp, as DDP does (`dp_reduction="sum"`: sums them, torchtitan's FSDP convention).

The loss is shared with the notebook's single-device reference (tplab/losses.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tplab.core import placements
from tplab.core.fsdp_layout import refuse_in_simulation
from tplab.core.pairing import infer_layout
from tplab.core.pytrees import call_model, leaves, map_tensors
from tplab.errors import LabError
from tplab.layouts import ParamLayout, tp_layout
from tplab.losses import call_loss, loss_context, with_grad
from tplab.mesh import MeshShape

__all__ = ["RANK_LOCAL", "GradJob", "StepResult", "call_loss", "loss_context", "parallel_step",
           "replica_slice", "sum_convention", "with_grad"]

RANK_LOCAL = "rank-local"  # an output each rank keeps as its own (a per-rank metric)


@dataclasses.dataclass(frozen=True, eq=False)
class GradJob:
    """What grad_check sends every rank (by pickle), made and checked in the notebook.

    `plan`: the `(model, mesh) -> model` function (`plans.parallelizer`'s); `mesh`: the
    check's (dp, tp) shape; `dp_reduction`: "mean" (DDP: parameter gradients averaged over
    dp, the reference's loss the mean of the replicas') or "sum" (summed: the loss_fn
    divides by the global count itself); `average_dp`: False when the plan reduces over
    dp itself; `context`: a factory of a context manager entered around forward and the
    loss (or None); `outputs`: {output path: placement string or RANK_LOCAL}, declared by
    the user; `out_shapes`: {output path: the one-device model's shape}, to read a plain
    tensor's layout from its shape."""

    build_model: Callable
    state: dict
    plan: Callable
    x: object
    loss_fn: Callable | None
    mesh: MeshShape
    average_dp: bool = True
    dp_reduction: str = "mean"
    context: Callable | None = None
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    out_shapes: dict[str, tuple] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class StepResult:
    """What one rank's `parallel_step` hands the notebook (by pickle, so both sides know
    the class): output leaves and input gradients by pytree path ("output.logits",
    "input[0]"), the loss, and every parameter's gradient with its layout. With dp > 1 the
    outputs, input gradients and loss are DTensors on the whole (dp, tp) mesh (LocalShards
    in the notebook). `read_as`: {output path: (placement, how)} for the plain-tensor
    outputs read as shards ("declared", or "inferred" from the shape)."""

    outputs: dict[str, object]
    loss: object
    input_grads: dict[str, object]
    params: dict[str, ParamLayout]
    read_as: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)


def parallel_step(job: GradJob) -> StepResult:
    """Build, load the reference weights, parallelise, one forward and backward. With
    dp > 1 on a (dp, tp) mesh: this replica's slice of the batch (see tplab/checks/grad.py)."""
    mesh = job.mesh.make()
    dp = job.mesh.dp
    model = job.build_model()
    model.load_state_dict(job.state)
    model = job.plan(model, mesh)
    refuse_in_simulation(model)
    if job.dp_reduction == "sum":
        sum_convention(model)
    x = map_tensors(lambda t: replica_slice(t, mesh), job.x) if dp > 1 else job.x
    x = with_grad(x)
    with job.context() if job.context else contextlib.nullcontext():
        out = call_model(model, x)  # may hold AsyncCollectiveTensors: .wait() would cut it
        outs = dict(leaves(out, "output"))
        read_as = {k: r for k, t in outs.items()
                   if (r := _read_as(k, t, job, mesh)) is not None}
        with loss_context(out):
            loss = _loss(job, out, x, read_as, outs)
            loss.backward()
    params = tp_layout(model)
    outs = {k: _as_shard(t, read_as[k][0], mesh) if k in read_as and dp == 1 else t
            for k, t in outs.items()}
    grads = {k: t.grad for k, t in leaves(x, "input") if t.is_floating_point()}
    if dp == 1:
        return StepResult(outs, loss.detach(), grads, params, read_as)
    return _on_whole_mesh(mesh, outs, loss, grads, params, job, read_as)


def _loss(job: GradJob, out, x, read_as: dict, outs: dict):
    """The loss; a LabError that names a plain output holding a local shard when the loss
    fails on it (an lm head planned with use_local_output=True: a local vocab shard)."""
    try:
        return call_loss(job.loss_fn, out, x)
    except (RuntimeError, IndexError, ValueError) as e:
        if not read_as or isinstance(e, LabError):
            raise
        name, (placement, _) = next(iter(read_as.items()))
        raise LabError(
            f"the loss failed on {name}, a plain tensor holding a local shard on the ranks "
            f"(local shape {tuple(outs[name].shape)}, the one-device model's "
            f"{tuple(job.out_shapes.get(name, ()))}: {placement}), such as an lm head "
            "planned with use_local_output=True, whose logits are the rank's own slice of "
            "the vocab. Plan it with use_local_output=False (a DTensor: its loss runs under "
            "loss_parallel()) or gather it (output_layouts=Replicate()), or compute the "
            "loss with the framework's vocab-parallel loss; a framework whose modules "
            "redistribute only inside its training context (torchtitan's) needs that "
            f"context entered on the ranks: grad_check(..., context=...). ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})") from e


def _read_as(name: str, t, job: GradJob, mesh) -> tuple[str, str] | None:
    """(placement on the tp dim, "declared" or "inferred") of a plain-tensor output that
    holds a local shard, else None (a DTensor says its own; a replica needs nothing)."""
    if isinstance(t, DTensor) or job.outputs.get(name) == RANK_LOCAL:
        return None
    declared = job.outputs.get(name)
    if declared is not None:
        return (declared, "declared") if placements.is_shard(declared) else None
    ref = job.out_shapes.get(name)
    if ref is None or job.mesh.tp < 2:
        return None
    if job.mesh.dp > 1 and len(ref):
        ref = (ref[0] // job.mesh.dp, *ref[1:])
    fit = infer_layout(tuple(t.shape), tuple(ref), job.mesh.tp)
    if fit is None or fit[1] or not placements.is_shard(fit[0]):
        return None
    return fit[0], "inferred"


def _as_shard(t, placement: str, mesh):
    """A plain local shard as a DTensor on the tp mesh, so that the notebook places it."""
    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    dim = placements.shard_dim(placement)
    dim = dim + t.ndim if dim < 0 else dim
    return DTensor.from_local(t.detach(), mesh, [Shard(dim)], run_check=False)


def sum_convention(model) -> None:
    """dp_reduction="sum": FSDP2's reductions as sum-only collectives, so that a plan that
    sums over dp as torchtitan does (`set_gradient_divide_factor(1.0)`, NCCL's PREMUL_SUM
    otherwise) runs on gloo, which lacks PREMUL_SUM. The divide factor stays the plan's:
    a plan that averages is checked as it is (and caught)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def replica_slice(x, mesh):
    """dp replica d's slice d of the batch (dim 0). index_select with a tensor index, not
    chunk: in tplab.simulate the dp coordinate holds every rank's value."""
    dp = mesh["dp"].size()
    n = x.shape[0] // dp
    return x.index_select(0, torch.arange(n, device=x.device) + mesh.get_local_rank("dp") * n)


def _on_whole_mesh(mesh, outs, loss, grads, params, job: GradJob, read_as):
    """dp > 1: outputs and input grads as DTensors on the whole (dp, tp) mesh, Shard(0)
    over dp, so that the notebook places them; the loss Partial over dp (each replica holds
    loss_d / dp of the mean, or loss_d of the sum); parameter gradients averaged (or
    summed) over dp (DDP), but not those FSDP2 manages (reduce-scattered by FSDP2 itself)."""
    dp = mesh["dp"].size()
    share = dp if job.dp_reduction == "mean" else 1

    def whole(t, over_dp, tp_placement=None):
        if t is None:
            return None
        tp_placement = tp_placement or Replicate()
        if isinstance(t, DTensor):  # on the tp sub-mesh: one placement
            tp_placement, t = t.placements[-1], t.to_local()
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
        t = t.detach()
        if isinstance(tp_placement, Shard) and tp_placement.dim < 0:
            tp_placement = Shard(tp_placement.dim + t.ndim)
        return DTensor.from_local(t, mesh, [over_dp, tp_placement], run_check=False)

    reduced = dict(params)
    for name, info in params.items():
        g = info.value
        if g is not None and not info.whole_mesh and job.average_dp and \
                not info.fsdp:
            g = g.detach().clone()
            dist.all_reduce(g, group=mesh.get_group("dp"))
            reduced[name] = dataclasses.replace(info, value=g / share)
    tp_of = {k: Shard(placements.shard_dim(p)) for k, (p, _) in read_as.items()}
    return StepResult({k: whole(v, Shard(0), tp_of.get(k)) for k, v in outs.items()},
                      whole(loss / share, Partial()),
                      {k: whole(None if g is None else g / share, Shard(0))
                       for k, g in grads.items()}, reduced, read_as)
