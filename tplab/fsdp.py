"""FSDP2 + TP, torchtitan's order: TP inside a node (`mesh["tp"]`), FSDP2 across (`mesh["dp"]`).

    plan = tplab.fsdp.fsdp_tp(tplab.plans.mlp())            # a (model, mesh) -> model plan
    report = tplab.grad_check(lab, build, plan, make_input, dp=2)
    report = tplab.train_check(lab, build, plan, make_batch, dp=2)

- `fsdp_tp(tp_plan, per_module=(), on="dp", reshard_after_forward=True)` returns a plan
  (picklable: it travels to the ranks) that applies `tp_plan` (a dict for `tplab.apply_plan`
  on `mesh["tp"]`, or a hand-written `(model, mesh) -> model` such as
  `tplab.megatron.parallelize`), then `fully_shard` on each submodule whose class name (a
  subclass's too) or module name is in `per_module` (torchtitan shards every transformer
  block), then on the root, all on `mesh[on]`. `on="tp"` is the bug of sharding over the TP dim.
- `managed(model)`: the parameters FSDP2 manages (public API: every parameter under an
  `FSDPModule`). Their gradients are FSDP's (reduce-scattered and averaged over dp), so
  tplab averages them no second time.
- `tp_view(p, value)`: a parameter that FSDP2 sharded on the dp mesh only, over a
  hand-written TP layer (its own `tp_placements`): the rank's whole TP piece (all-gathered
  over dp), which the notebook pairs as it pairs plain TP.
- `refuse_in_simulation(model)`: under `tplab.simulate`, a PlanError with torch's reason
  when FSDP2 manages a parameter (FSDP2 cannot run there).

Gradient accumulation: FSDP2 reduce-scatters after every backward by default; under
`model.set_requires_gradient_sync(False)` it keeps unsharded gradients until the last
micro-batch (see `accumulate_step`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from tplab.core.fsdp_layout import (
    SIMULATE_REASON,
    managed,
    over_piece,
    refuse_in_simulation,
    tp_placement,
    tp_view,
)
from tplab.core.pytrees import call_model, map_tensors
from tplab.errors import PlanError
from tplab.layouts import tp_layout
from tplab.losses import call_loss, loss_context
from tplab.mesh import make_mesh
from tplab.plans import apply_plan
from tplab.tracing import trace

__all__ = ["SIMULATE_REASON", "accumulate_step", "apply_fsdp_tp", "fsdp_tp", "managed",
           "over_piece", "placements_after", "refuse_in_simulation", "tp_placement",
           "traced_step", "tp_view"]

def apply_fsdp_tp(model, mesh, tp_plan=None, per_module=(), on: str = "dp",
                  reshard_after_forward: bool = True, batch: str = "dp", reduce: str = "mean"):
    """TP (`tp_plan`) on mesh["tp"], then fully_shard per submodule and on the root over
    mesh[on]. See the module docstring."""
    if batch not in ("dp", "global"):
        raise PlanError(f"fsdp_tp: batch is 'dp' or 'global' (the bug), not {batch!r}")
    if reduce not in ("mean", "sum"):
        raise PlanError(f"fsdp_tp: reduce is 'mean' or 'sum' (the bug), not {reduce!r}")
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "dp" not in names or "tp" not in names:
        raise PlanError(f"fsdp_tp needs a (dp, tp) mesh (grad_check/train_check with dp=); got "
                        f"mesh dims {names or 'unnamed'}")
    if on not in names:
        raise PlanError(f"fsdp_tp: on={on!r} is not a mesh dim ({', '.join(names)})")
    if isinstance(tp_plan, dict):
        model = apply_plan(model, mesh["tp"], tp_plan)
    elif tp_plan is not None:
        model = tp_plan(model, mesh)
    wanted = set(per_module)
    for name, m in list(model.named_modules()):
        if name and ({c.__name__ for c in type(m).__mro__} & wanted or name in wanted):
            fully_shard(m, mesh=mesh[on], reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh[on], reshard_after_forward=reshard_after_forward)
    if reduce == "sum":  # gloo has no PREMUL_SUM: a plain SUM, and no divide
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
    if batch == "global":
        model.register_forward_pre_hook(functools.partial(_global_rank_rows, mesh=mesh),
                                        prepend=True)
    return model


def _global_rank_rows(module, args, mesh):
    """The bug `batch="global"`: a data loader indexed by the global rank, not the dp rank.
    The rows of dp slice `global rank % dp` of the whole batch (gathered back over dp), so
    the tp ranks of one replica see different rows."""
    dp = mesh["dp"].size()
    index = torch.zeros((), dtype=torch.long) + dist.get_rank() % dp

    def rows(x):
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return x
        whole = funcol.all_gather_tensor_autograd(x.contiguous(), 0, mesh.get_group("dp"))
        whole = whole.wait() if hasattr(whole, "wait") else whole
        n = x.shape[0]
        return whole.index_select(0, torch.arange(n) + index * n)

    return tuple(rows(a) for a in args)


def fsdp_tp(tp_plan=None, per_module=(), on: str = "dp", reshard_after_forward: bool = True,
            batch: str = "dp", reduce: str = "mean"):
    """A `(model, mesh) -> model` plan: TP, then FSDP2 over dp (see the module docstring).
    Bugs to plant: `on="tp"` (FSDP2 shards over the TP dim), `batch="global"` (each rank
    takes the rows of its global rank, not of its dp rank), `reduce="sum"` (FSDP2 sums the
    replicas' gradients instead of averaging them)."""
    if tp_plan is not None and not isinstance(tp_plan, dict) and not callable(tp_plan):
        raise PlanError(f"fsdp_tp: tp_plan is a dict for tplab.apply_plan or a (model, mesh) "
                        f"-> model function, not {type(tp_plan).__name__}")
    return functools.partial(apply_fsdp_tp, tp_plan=tp_plan, per_module=tuple(per_module),
                             on=on, reshard_after_forward=reshard_after_forward,
                             batch=batch, reduce=reduce)


def accumulate_step(model, optimizer, batch, micro: int = 2, loss_fn=None,
                    sync_each: bool = False):
    """A training step in `micro` micro-batches (dim 0 of the batch): FSDP2 reduce-scatters
    after every backward (`sync_each=True`), or, torchtitan's way, keeps unsharded gradients
    under `set_requires_gradient_sync(False)` until the last one. On one device (no FSDP) the
    same arithmetic: the loss of each micro-batch divided by `micro`."""
    parts = [map_tensors(lambda t, i=i: t.chunk(micro)[i], batch) for i in range(micro)]
    fsdp = isinstance(model, FSDPModule)
    total = 0.0
    for i, part in enumerate(parts):
        if fsdp and not sync_each:
            model.set_requires_gradient_sync(i == micro - 1)
        out = call_model(model, part)
        with loss_context(out):
            loss = call_loss(loss_fn, out, part) / micro
            loss.backward()
        total = total + loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def placements_after(build_model, plan, dp: int) -> dict[str, dict[str, str]]:
    """Rank side, for a lesson: {parameter: {mesh dim: placement}} of `build_model()` after
    `plan` on a (dp, tp) mesh of the whole world."""
    mesh = make_mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = plan(build_model(), mesh)
    return {n: i.mesh_placements for n, i in tp_layout(model, of="param").items()}


def traced_step(build_model, plan, dp: int, x, loss_fn=None) -> list[dict]:
    """Rank side, for a lesson: tplab.trace's records of one forward and backward of the
    planned model on this replica's slice of `x` (FSDP2's all-gathers and reduce-scatters
    on "dp" among TP's collectives on "tp"), after one untraced step (FSDP2's lazy init)."""

    mesh = make_mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = plan(build_model(), mesh)
    mine = x.chunk(dp)[mesh.get_local_rank("dp")]

    def step():
        out = model(mine)
        with loss_context(out):
            call_loss(loss_fn, out, mine).backward()

    step()
    with trace() as t:
        step()
    return [{k: r[k] for k in ("seq", "phase", "module", "op", "group")} for r in t.records]


def apply_hsdp(model, mesh, replicate: int = 2, tp_plan=None, reduce: str = "mean"):
    """HSDP (FSDP2 on a 2-D mesh: replicas of shards): the dp dim split into
    (dp_replicate, dp_shard); parameters replicated over the first, sharded over the second.
    With tp > 1 (8 ranks at least: 2 x 2 x 2), torchtitan's HSDP x TP: one 3-D mesh
    (dp_replicate, dp_shard, tp) of the same ranks (tp innermost, as `make_mesh`), the
    DTensor plan `tp_plan` on its "tp" dim, then fully_shard on ("dp_replicate",
    "dp_shard"). `reduce="sum"` plants the bug of summing the replicas' gradients."""
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    if reduce not in ("mean", "sum"):
        raise PlanError(f"hsdp: reduce is 'mean' or 'sum' (the bug), not {reduce!r}")
    if tp > 1 and not isinstance(tp_plan, dict):
        raise PlanError(f"hsdp: tp={tp} needs tp_plan, a DTensor plan (a dict for "
                        "tplab.apply_plan), applied on the 3-D mesh's tp dim (HSDP x TP)")
    if tp == 1 and tp_plan is not None:
        raise PlanError("hsdp: tp_plan given on a mesh with tp=1: nothing to split")
    if dp % replicate or dp == replicate:
        raise PlanError(f"hsdp: dp={dp} must be a multiple of replicate={replicate} with "
                        "at least 2 shards in each replica")
    if tp == 1:
        hsdp = init_device_mesh(mesh.device_type, (replicate, dp // replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        root = init_device_mesh(mesh.device_type, (replicate, dp // replicate, tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = apply_plan(model, root["tp"], tp_plan)
        hsdp = root["dp_replicate", "dp_shard"]
    fully_shard(model, mesh=hsdp)
    if reduce == "sum":  # gloo has no PREMUL_SUM: a plain SUM, and no divide
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
    return model


def hsdp(replicate: int = 2, tp_plan: dict | None = None, reduce: str = "mean"):
    """A `(model, mesh) -> model` plan: `apply_hsdp` (see there)."""
    return functools.partial(apply_hsdp, replicate=replicate, tp_plan=tp_plan, reduce=reduce)
