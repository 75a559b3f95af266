"""FSDP2 + TP, torchtitan's order: TP inside a node (`mesh["tp"]`), FSDP2 across (`mesh["dp"]`).

    plan = tplab.fsdp.fsdp_tp(tplab.plans.mlp())            # a (model, mesh) -> model plan
    report = tplab.grad_check(lab, build, plan, make_input, dp=2)
    report = tplab.train_check(lab, build, plan, make_batch, dp=2)

- `fsdp_tp(tp_plan, per_module=(), on="dp", reshard_after_forward=True)` returns a plan
  (picklable: it travels to the ranks) that applies `tp_plan` (a dict for `tplab.apply_plan`
  on `mesh["tp"]`, or a hand-written `(model, mesh) -> model` such as
  `tplab.megatron.parallelize`), then `fully_shard` on each submodule whose class name (a
  subclass's too) or module name is in `per_module` (torchtitan shards every transformer
  block; a name that matches nothing is a PlanError with the closest names), then on the
  root, all on `mesh[on]`. `on="tp"` is the bug of sharding over the TP dim (over a
  hand-written plan; torch refuses it over a DTensor plan, and so does fsdp_tp, at once).
  Its arguments are checked when it is called, in the notebook.
- Gradient hooks carried over: `fully_shard` replaces every parameter by a new one (its
  dp shard), so the hooks a hand-written plan registered on a parameter
  (`megatron.parallelize(sequence_parallel=True)` sums the norms' partial gradients over
  tp with one) would be lost. `carry_grad_hooks` registers them again on the parameter
  FSDP2 unshards for the module's forward, the one autograd accumulates into before
  FSDP2 reduce-scatters it (Megatron-LM all-reduces those gradients before its own
  data-parallel reduction too, in `finalize_model_grads`).
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

import difflib
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from tplab.core.compositions import refuse_in_fully_shard
from tplab.core.fsdp_layout import (
    SIMULATE_REASON,
    managed,
    over_piece,
    refuse_in_simulation,
    tp_view,
)
from tplab.core.pytrees import call_model, leaves, map_tensors
from tplab.errors import LabError, PlanError
from tplab.layouts import tp_layout
from tplab.losses import call_loss, loss_context
from tplab.mesh import make_mesh
from tplab.plans import apply_plan
from tplab.tracing import trace

__all__ = ["SIMULATE_REASON", "FSDPPlan", "accumulate_step", "apply_fsdp_tp", "carry_grad_hooks",
           "fsdp_tp", "hsdp", "managed", "over_piece", "placements_after",
           "refuse_in_simulation", "traced_step", "tp_view"]

ON_TP_DTENSOR = ("fsdp_tp: on='tp' over a DTensor plan: FSDP2 would shard parameters that "
                 "are already DTensors on the tp dim over that same dim, and torch refuses it "
                 "(\"Cannot concatenate overlapping meshes\"). The bug on='tp' is planted over "
                 "a hand-written plan (tplab.megatron.parallelize); FSDP2 goes on='dp'")

def apply_fsdp_tp(model, mesh, tp_plan=None, per_module=(), on: str = "dp",
                  reshard_after_forward: bool = True, batch: str = "dp", reduce: str = "mean"):
    """TP (`tp_plan`) on mesh["tp"], then fully_shard per submodule and on the root over
    mesh[on]. See the module docstring."""
    _check_args(per_module, on, reshard_after_forward, batch, reduce)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "dp" not in names or "tp" not in names:
        raise PlanError(f"fsdp_tp needs a (dp, tp) mesh (grad_check/train_check with dp=); got "
                        f"mesh dims {names or 'unnamed'}")
    if isinstance(tp_plan, dict):
        model = apply_plan(model, mesh["tp"], tp_plan)
    elif tp_plan is not None:
        model = tp_plan(model, mesh)
    if on == "tp" and any(isinstance(p, DTensor) for p in model.parameters()):
        raise PlanError(ON_TP_DTENSOR)
    refuse_in_fully_shard(model, per_module)
    targets = shard_targets(model, per_module)
    hooks = carry_grad_hooks(model)
    for m in targets:
        fully_shard(m, mesh=mesh[on], reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh[on], reshard_after_forward=reshard_after_forward)
    hooks()
    if reduce == "sum":  # gloo has no PREMUL_SUM: a plain SUM, and no divide
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
    if batch == "global":
        model.register_forward_pre_hook(functools.partial(_global_rank_rows, mesh=mesh),
                                        prepend=True)
    return model


def shard_targets(model: torch.nn.Module, per_module) -> list[torch.nn.Module]:
    """The submodules whose class name (a subclass's too) or module name is in `per_module`;
    a PlanError naming each name that matches none, with the closest the model has."""
    wanted = set(per_module)
    found: list[torch.nn.Module] = []
    matched: set[str] = set()
    known: set[str] = set()
    for name, m in model.named_modules():
        if not name:
            continue
        kinds = {c.__name__ for c in type(m).__mro__} - {"object", "Module"}
        known |= kinds | {name}
        hit = (kinds | {name}) & wanted
        if hit:
            found.append(m)
            matched |= hit
    missing = sorted(wanted - matched)
    if missing:
        close = {n: difflib.get_close_matches(n, known, n=3, cutoff=0.5) for n in missing}
        words = "; ".join(f"{n!r} (closest: {', '.join(map(repr, c))})" if c else repr(n)
                          for n, c in close.items())
        raise PlanError(f"fsdp_tp: per_module names a submodule class or module name of "
                        f"{type(model).__name__}; these match none: {words}")
    return found


class _UnshardedHooks:
    """A forward pre-hook: the gradient hooks of the parameter `name` registered on the
    tensor the module holds when it runs (FSDP2's unsharded parameter), once per tensor."""

    def __init__(self, name: str, grad_hooks: list, accumulate_hooks: list):
        self.name, self.grad_hooks, self.accumulate_hooks = name, grad_hooks, accumulate_hooks
        self.hooked: list[torch.Tensor] = []

    def __call__(self, module, args):
        p = getattr(module, self.name)
        if p is None or any(p is q for q in self.hooked):
            return
        for hook in self.grad_hooks:
            p.register_hook(hook)
        for hook in self.accumulate_hooks:
            p.register_post_accumulate_grad_hook(hook)
        self.hooked.append(p)


def carry_grad_hooks(model: torch.nn.Module):
    """Read, before fully_shard, the gradient hooks on `model`'s parameters (torch keeps a
    tensor's in `_backward_hooks` and `_post_accumulate_grad_hooks`); returns a function
    that, called after fully_shard, registers them again where FSDP2 keeps the gradient
    (see the module docstring)."""
    carried = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            grad = list((getattr(p, "_backward_hooks", None) or {}).values())
            accumulate = list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())
            if grad or accumulate:
                carried.append((module, _UnshardedHooks(name, grad, accumulate)))

    def register():
        for module, hook in carried:
            module.register_forward_pre_hook(hook)

    return register


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


def _check_args(per_module, on, reshard_after_forward, batch, reduce) -> None:
    """fsdp_tp's own arguments (in the notebook when it is called, and again on the ranks)."""
    if isinstance(per_module, str) or not all(isinstance(n, str) for n in per_module):
        raise PlanError(f"fsdp_tp: per_module is a tuple of submodule class or module names, "
                        f"such as ('Block',), not {per_module!r}")
    if on not in ("dp", "tp"):
        raise PlanError(f"fsdp_tp: on is the mesh dim FSDP2 shards over, 'dp' or 'tp' (the "
                        f"bug), not {on!r}")
    if not isinstance(reshard_after_forward, bool):
        raise PlanError(f"fsdp_tp: reshard_after_forward is True or False, not "
                        f"{reshard_after_forward!r}")
    if batch not in ("dp", "global"):
        raise PlanError(f"fsdp_tp: batch is 'dp' or 'global' (the bug), not {batch!r}")
    if reduce not in ("mean", "sum"):
        raise PlanError(f"fsdp_tp: reduce is 'mean' or 'sum' (the bug), not {reduce!r}")


class FSDPPlan:
    """A plan that applies FSDP2 (`fsdp_tp`, `hsdp`): `apply(model, mesh, **keywords)`,
    which grad_check and train_check recognise before anything runs (FSDP2 cannot run under
    tplab.simulate: `refuse_plan_in_simulation`), and whose `check_plan(model, tp)` they
    call (tplab.plans.parallelizer)."""

    applies_fsdp2 = True

    def __init__(self, apply, **keywords):
        self.apply, self.keywords = apply, keywords

    def __call__(self, model: torch.nn.Module, mesh) -> torch.nn.Module:
        return self.apply(model, mesh, **self.keywords)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.keywords.items())
        return f"{self.apply.__name__}({args})"

    def check_plan(self, model: torch.nn.Module, tp: int) -> None:
        """In the notebook, on the unparallelised model: a DTensor plan keeps every module
        and its name, so `per_module` is matched here (a hand-written one may replace
        modules: matched on the ranks)."""
        per_module = self.keywords.get("per_module", ())
        if per_module and isinstance(self.keywords.get("tp_plan"), dict):
            shard_targets(model, per_module)


def fsdp_tp(tp_plan=None, per_module=(), on: str = "dp", reshard_after_forward: bool = True,
            batch: str = "dp", reduce: str = "mean") -> FSDPPlan:
    """A `(model, mesh) -> model` plan: TP, then FSDP2 over dp (see the module docstring).
    Bugs to plant: `on="tp"` (FSDP2 shards over the TP dim), `batch="global"` (each rank
    takes the rows of its global rank, not of its dp rank), `reduce="sum"` (FSDP2 sums the
    replicas' gradients instead of averaging them)."""
    if tp_plan is not None and not isinstance(tp_plan, dict) and not callable(tp_plan):
        raise PlanError(f"fsdp_tp: tp_plan is a dict for tplab.apply_plan or a (model, mesh) "
                        f"-> model function, not {type(tp_plan).__name__}")
    if not isinstance(per_module, (str, tuple, list, set, frozenset)):
        raise PlanError(f"fsdp_tp: per_module is a tuple of submodule class or module names, "
                        f"such as ('Block',), not {per_module!r}")
    _check_args(per_module, on, reshard_after_forward, batch, reduce)
    if on == "tp" and isinstance(tp_plan, dict):
        raise PlanError(ON_TP_DTENSOR)
    return FSDPPlan(apply_fsdp_tp, tp_plan=tp_plan, per_module=tuple(per_module), on=on,
                    reshard_after_forward=reshard_after_forward, batch=batch, reduce=reduce)


def accumulate_step(model, optimizer, batch, micro: int = 2, loss_fn=None,
                    sync_each: bool = False):
    """A training step in `micro` micro-batches (dim 0 of the batch): FSDP2 reduce-scatters
    after every backward (`sync_each=True`), or, torchtitan's way, keeps unsharded gradients
    under `set_requires_gradient_sync(False)` until the last one. On one device (no FSDP) the
    same arithmetic: the loss of each micro-batch divided by `micro`. `micro` divides dim 0
    of every tensor of `batch` (a replica's rows, on the ranks)."""
    _check_micro(micro, batch)
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


def _check_micro(micro, batch) -> None:
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise LabError(f"accumulate_step: micro is the number of micro-batches, a positive "
                       f"int, not {micro!r}")
    rows = {t.shape[0] for _, t in leaves(batch) if t.ndim}
    bad = sorted(n for n in rows if n % micro)
    if bad:
        raise LabError(f"accumulate_step: micro={micro} must divide the rows of the batch (dim "
                       f"0; on the ranks a replica's share of it), but it has {bad[0]} rows: "
                       f"use a micro in {[d for d in range(1, bad[0] + 1) if bad[0] % d == 0]}")


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
    _check_hsdp(replicate, tp_plan, reduce)
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
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
    hooks = carry_grad_hooks(model)
    fully_shard(model, mesh=hsdp)
    hooks()
    if reduce == "sum":  # gloo has no PREMUL_SUM: a plain SUM, and no divide
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
    return model


def _check_hsdp(replicate, tp_plan, reduce) -> None:
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise PlanError(f"hsdp: replicate is the number of replicas (dp_replicate), a positive "
                        f"int that divides dp with at least 2 shards each, not {replicate!r}")
    if tp_plan is not None and not isinstance(tp_plan, dict):
        raise PlanError(f"hsdp: tp_plan is a DTensor plan (a dict for tplab.apply_plan) or "
                        f"None, not {type(tp_plan).__name__}")
    if reduce not in ("mean", "sum"):
        raise PlanError(f"hsdp: reduce is 'mean' or 'sum' (the bug), not {reduce!r}")


def hsdp(replicate: int = 2, tp_plan: dict | None = None, reduce: str = "mean") -> FSDPPlan:
    """A `(model, mesh) -> model` plan: `apply_hsdp` (see there); its arguments checked here."""
    _check_hsdp(replicate, tp_plan, reduce)
    return FSDPPlan(apply_hsdp, replicate=replicate, tp_plan=tp_plan, reduce=reduce)
