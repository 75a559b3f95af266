"""grad_check (notebook side): does the tensor-parallel model compute what the single-device
model computes?

    report = tplab.grad_check(lab, build_model, plan, make_input, loss_fn=None)
    report = tplab.grad_check(lab, build_model, plan, make_input, dp=2, tp=2)  # 2-D
    report = tplab.grad_check(lab, build, my_plan, make_input, param_map={"w1": "fc1.weight"})

How the pieces are called (the same in processes and in `tplab.simulate`):
- `build_model()` takes no arguments. It is called once in the notebook for the reference,
  and once on every rank, which then loads the notebook model's initial weights (so the
  weights are identical even if build_model is not deterministic). The model is built
  whole; the plan splits it. By default the tp degree is the lab's world size (a 1-D mesh
  `make_mesh(tp=world_size)` made on the ranks).
- `make_input()` takes no arguments and is called ONCE, in the notebook; the value is sent
  to every rank (no rank-dependent randomness). It may be a tensor (`model(x)`), a tuple
  or list (`model(*x)`), a dict (`model(**x)`, as transformers models take a batch) or any
  other pytree (`model(x)`). Its floating-point tensors get requires_grad=True, so their
  gradients are checked too (integer token ids are not).
- `plan` is a dict for `tplab.apply_plan` or a callable `(model, mesh) -> model`: the
  hand-written path, such as `tplab.megatron.parallelize` or your own Megatron-style
  module with its own parameter names (see "Pairing" below).
- The output may be a tensor or any pytree: tuples, lists, dicts, dataclasses, transformers'
  `ModelOutput`. Its tensors are compared leaf by leaf ("output.logits", "output[0]").
- `loss_fn(output, input) -> scalar` (or `loss_fn(output)`) gets the output as the model
  returns it. The default is `0.5 * sum(leaf**2)` over the output's floating tensors,
  whose gradient is the output itself. When an output is a DTensor sharded on its last dim
  (an lm head planned for loss parallelism), loss and backward run under `loss_parallel()`.
- `dp=` and/or `tp=` (dp * tp = world size; give one and the other follows) check on a
  2-D mesh `make_mesh(dp=dp, tp=tp)`, data parallel over dp. `make_input()` then gives the
  WHOLE batch: dp replica d gets the d-th of dp equal slices of dim 0 of every tensor (as
  a DistributedSampler would). Each replica's parameter gradients are averaged over dp
  after backward (DDP's all-reduce; `average_dp=False` when the plan does that itself).
  The reference is the single-device model on the whole batch with the MEAN of the dp
  slices' losses; the ranks' input gradients are divided by dp to match. Gradients that
  the plan made DTensors on the whole mesh (FSDP2) are taken as they are: FSDP2 itself
  reduces them, so they must be reduced as `dp_reduction` says (FSDP2's default averages).
- `dp_reduction="sum"`: torchtitan's convention. Gradients are SUMMED over dp (FSDP2's
  `set_gradient_divide_factor(1.0)`; grad_check's own DDP all-reduce sums too) and
  `loss_fn` divides by the global token count itself; the reference's loss is the SUM of
  the dp slices' losses, and the input gradients are not divided. FSDP2's reductions then
  run as sum-only collectives (gloo lacks the PREMUL_SUM a divide factor of 1 asks for).
- `context=`: a function of no arguments returning a context manager (a
  `contextlib.contextmanager`, `functools.partial(...)` of one), entered on every rank
  around forward, the loss and backward: a framework's training context (torchtitan reads
  its mesh from one). The one-device reference runs without it.
- `outputs={path: layout}` for outputs a framework leaves per rank: "rank-local" (each
  rank's own value, such as a loss its trainer averages: not compared, noted), or the
  layout on the tp dim of a plain-tensor output (an int dim, "Shard(d)", a Shard, or None
  for a replica). Without it a plain output whose shape is the reference's with one dim
  divided by tp is read as sharded there (inferred, and said so in its row's note).
  Paths are the rows' names ("output", "output.logits", "loss").

Each rank runs `tplab.rank.grad_step.parallel_step`; what it returns is paired and
assembled here. Pairing (tplab.core.pairing): a parameter on the ranks is compared with the
reference parameter of the same name; the rest are paired by registration order and shape.
Its layout comes from the DTensor, from a `tp_placements` dict on its module, or from its
shape (a replica, or one dimension divided by the tp size: sharded there, in rank order, as
`torch.chunk` splits it). `param_map={"w1": "fc1.weight"}` or `{"w1": ("fc1.weight", 0)}`
(0: sharded on dim 0; None: replicated) states a pairing. A parameter that pairs with
nothing is reported as "unpaired" with how to pair it, and the check does not pass.

The report has one row per tensor: every output leaf (and the loss), every input gradient,
every parameter gradient (assembled from the ranks' pieces), and for every tensor that
should be the same on every rank, the spread across ranks (kind "replica_spread").
Each row is judged relative to its own tensor's scale, as torch.testing judges: max |error|
<= atol + rtol * max|reference|, rtol by the model's dtype and atol a floor for what is near
zero (tplab/checks/grad_tolerance.py); the row's "tol" says what it used. `atol`/`rtol`
may be numbers or numeric strings (as a config file gives them), finite and >= 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tplab import rng
from tplab.checks.grad_params import assemble, param_rows
from tplab.checks.grad_report import GradCheckReport, GradRow, compare
from tplab.checks.grad_tolerance import TOLERANCES, check_tolerance, kind_floors, tolerances
from tplab.core import placements
from tplab.core.fsdp_layout import refuse_plan_in_simulation
from tplab.core.pytrees import call_model, leaves, map_tensors
from tplab.core.transfer import LocalShard
from tplab.errors import LabError
from tplab.fsdp_report import name_mesh_dims, replica_grads
from tplab.losses import DP_REDUCTIONS, call_loss, with_grad
from tplab.mesh import MeshShape
from tplab.plans import parallelizer
from tplab.rank.grad_step import RANK_LOCAL, GradJob, parallel_step

__all__ = ["DP_REDUCTIONS", "RANK_LOCAL", "TOLERANCES", "GradCheckReport", "assemble",
           "check_tolerance", "compare", "grad_check", "mesh_shape", "output_specs",
           "state_of", "tensor_rows", "tolerances"]


def tensor_rows(name: str, kind: str, values: list, ref, atol: float, rtol: float,
                note: str = "", sizes: tuple = ()) -> list[GradRow]:
    """The report's rows for one tensor from the ranks' values (one per rank): the
    assembled tensor against `ref`, and the spread across its replicas when it has any.
    What `grad_check` and the Explorer (tplab/checks/explorer.py) both report. `sizes`: the mesh's
    group sizes, the factors a collective that summed copies could explain."""
    full, spread = assemble(values)
    ops = [placements.parse(p)[1] for p in values[0].placements
           if placements.is_partial(p)] if isinstance(values[0], LocalShard) else []
    if not note and ops:
        how = "summed" if set(ops) == {"sum"} else "averaged" if set(ops) == {"avg"} else \
            "reduced (" + ", ".join(ops) + ")"
        note = f"Partial on the ranks (not yet reduced); {how} here"
    rows = [compare(name, kind, full, ref, atol, rtol, note, sizes=sizes)]
    if spread is not None:
        rows.append(compare(name, "replica_spread", spread, ref, atol, rtol))
    return rows


def mesh_shape(world: int, dp: int | None, tp: int | None) -> tuple[int, int]:
    """(dp, tp) from what was given: neither -> (1, world); one -> the other from world
    (`tplab.mesh.MeshShape.of`, which checks them)."""
    shape = MeshShape.of(world, dp, tp)
    return shape.dp, shape.tp


def state_of(model) -> dict:
    """The model's state_dict to load on the ranks, tensors cloned; other entries (a
    Megatron module's `_extra_state: None`) as they are."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()}


def _reference(model, x, loss_fn, dp, dp_reduction="mean"):
    """The single-device step: (output leaves, loss, input with gradients)."""
    x_ref = with_grad(x)
    if dp == 1:
        out = call_model(model, x_ref)
        loss = call_loss(loss_fn, out, x_ref)
        outs = dict(leaves(out, "output"))
    else:  # the mean (or sum) of the dp replicas' losses, each on its slice of the batch
        for path, t in leaves(x, "input"):
            if t.ndim == 0 or t.shape[0] % dp:
                raise LabError(f"grad_check: dim 0 of the {path} (shape {tuple(t.shape)}) must "
                               f"divide into dp={dp} equal slices, one per data-parallel "
                               "replica")
        # one forward on the whole batch, as the replicas' masks (tplab.rng) are drawn for
        # it; the loss of each replica's slice of it
        out = call_model(model, x_ref)
        outs = dict(leaves(out, "output"))
        loss = sum(call_loss(loss_fn, *map_tensors(lambda t, d=d: t.chunk(dp)[d], (out, x_ref)))
                   for d in range(dp)) / (dp if dp_reduction == "mean" else 1)
    loss.backward()
    return outs, loss, x_ref


def _placement_of(spec) -> str | None:
    """An `outputs=` value as a placement string on the tp dim, or None when it is none."""
    if spec is None:
        return placements.REPLICATE
    if isinstance(spec, int) and not isinstance(spec, bool):
        return placements.shard(spec)
    try:
        kind, arg = placements.parse(spec if isinstance(spec, str) else placements.name(spec))
    except ValueError:
        return None
    return {placements.SHARD_KIND: placements.shard(arg) if arg is not None else None,
            placements.REPLICATE_KIND: placements.REPLICATE}.get(kind)


def output_specs(outputs, names: list[str]) -> dict[str, str]:
    """`outputs=` as {output path: "Shard(d)", "Replicate()" or RANK_LOCAL}: a value is
    "rank-local", a placement (torch's or its string), an int d (Shard(d)) or None (a
    replica); a path the model's output does not have is a LabError listing its paths."""
    if outputs is None:
        return {}
    if not isinstance(outputs, dict):
        raise LabError(f"grad_check: outputs is a dict {{output path: layout}} such as "
                       f"{{'output.logits': 'Shard(-1)', 'loss': {RANK_LOCAL!r}}}, got "
                       f"{type(outputs).__name__} {outputs!r}")
    specs = {}
    for name, spec in outputs.items():
        if name not in names:
            raise LabError(f"grad_check: outputs names {name!r}, which the output does not "
                           f"have; its paths: {', '.join(map(repr, names))}")
        specs[name] = RANK_LOCAL if spec == RANK_LOCAL else _placement_of(spec)
        if specs[name] is None:
            raise LabError(f"grad_check: outputs[{name!r}]={spec!r}: give {RANK_LOCAL!r} "
                           "(each rank's own value, not compared), a shard dim (an int, "
                           "'Shard(d)' or Shard(d)) or None / 'Replicate()'")
    return specs


def _check_options(dp_reduction, average_dp, context, param_map) -> None:
    if dp_reduction not in DP_REDUCTIONS:
        raise LabError(f"grad_check: dp_reduction={dp_reduction!r}: one of "
                       f"{', '.join(map(repr, DP_REDUCTIONS))} (how the replicas' gradients "
                       "are reduced over dp: averaged as DDP, or summed as torchtitan's FSDP)")
    if not isinstance(average_dp, bool):
        raise LabError(f"grad_check: average_dp must be True or False, got {average_dp!r}")
    if context is not None and not callable(context):
        raise LabError(f"grad_check: context must be a function of no arguments that returns "
                       f"a context manager (such as functools.partial(my_context, mesh_args))"
                       f", got {type(context).__name__} {context!r}")
    if param_map is not None and not isinstance(param_map, dict):
        raise LabError("grad_check: param_map is a dict {parallel name: reference name} or "
                       "{parallel name: (reference name, shard dim or None)}")


def grad_check(lab, build_model, plan, make_input, loss_fn=None, atol: float | None = None,
               rtol: float | None = None, *, dp: int | None = None, tp: int | None = None,
               average_dp: bool = True, param_map: dict | None = None,
               context=None, outputs: dict | None = None,
               dp_reduction: str = "mean") -> GradCheckReport:
    """Run the single-device reference here and the parallel model on `lab` (a Lab or a
    Simulation) with identical weights and input; compare every output, input gradient
    and parameter gradient. `dp`/`tp` check data x tensor parallelism on a 2-D mesh;
    `param_map` pairs parameters by hand; `context`, `outputs` and `dp_reduction` are for
    frameworks (a context on the ranks, outputs left per rank or sharded, FSDP's sum
    convention). See the module docstring."""
    shape = MeshShape.of(lab.world_size, dp, tp)
    atol, rtol = check_tolerance(atol, "atol"), check_tolerance(rtol, "rtol")
    _check_options(dp_reduction, average_dp, context, param_map)
    refuse_plan_in_simulation(plan, lab.in_process)  # FSDP2 under tplab.simulate
    model = build_model()
    x = make_input()
    # a PlanError here, before anything reaches the ranks
    step_plan = parallelizer(plan, model, shape.tp, x)
    state = state_of(model)
    rng.reference_tracker(model, shape.tp)  # tplab.rng's "tp" masks, as the tp ranks draw them
    out_ref, loss_ref, x_ref = _reference(model, x, loss_fn, shape.dp, dp_reduction)
    specs = output_specs(outputs, [*out_ref, "loss"])
    atol, rtol, dtype = tolerances([*model.parameters(), *out_ref.values()], atol, rtol)
    floors = kind_floors({"output": [*out_ref.values(), loss_ref],
                          "input_grad": [t.grad for _, t in leaves(x_ref, "input")],
                          "param_grad": [p.grad for p in model.parameters()]}, atol, dtype)
    job = GradJob(build_model, state, step_plan, x, loss_fn, shape, average_dp, dp_reduction,
                  context, specs, {k: tuple(v.shape) for k, v in out_ref.items()})
    results = lab.run(parallel_step, job)
    rows, notes = _tensor_rows(results, out_ref, loss_ref, x_ref, job, floors, rtol)
    wholes: dict = {}
    notes += param_rows(model, results, shape.tp, param_map, rows, floors["param_grad"], rtol,
                        wholes, _sizes(shape))
    if shape.dp > 1 and dp_reduction == "mean" and any(
            r["kind"] == "param_grad" and not r["ok"] for r in rows):
        # which mesh dim a wrong gradient comes from (tplab/fsdp_report.py)
        name_mesh_dims(rows, wholes, replica_grads(build_model, state, x, loss_fn, shape.dp),
                       shape.dp, floors["param_grad"], rtol)
    _per_rank_loss(rows, results[0].read_as)
    return GradCheckReport(rows, len(results), atol, rtol, loss_ref.item(),
                           {"dp": shape.dp, "tp": shape.tp}, notes,
                           dtype=str(dtype).removeprefix("torch."), floors=floors)


def _sizes(shape: MeshShape) -> tuple[int, ...]:
    """The group sizes of the mesh: how many copies a collective on it can sum."""
    return tuple(sorted({n for n in (shape.dp, shape.tp, shape.dp * shape.tp) if n > 1}))


def _tensor_rows(results, out_ref, loss_ref, x_ref, job: GradJob, floors, rtol):
    """(rows, notes) of the outputs, the loss and the input gradients."""
    rows: list[GradRow] = []
    notes: list[str] = []
    sizes = _sizes(job.mesh)
    read_as = results[0].read_as

    def add(name, kind, values, ref, note=""):
        if job.outputs.get(name) == RANK_LOCAL:
            notes.append(f"{name} is rank-local (outputs=): each rank's own value, not "
                         "compared")
            return
        if name in read_as and not note:
            placement, how = read_as[name]
            note = f"a plain tensor on the ranks, read as {placement} ({how})"
        rows.extend(tensor_rows(name, kind, values, ref, floors[kind], rtol, note, sizes))

    for name in [*out_ref, *(k for k in results[0].outputs if k not in out_ref)]:
        add(name, "output", [r.outputs.get(name) for r in results], out_ref.get(name))
    dp = job.mesh.dp
    add("loss", "output", [r.loss for r in results], loss_ref,
        f"the {job.dp_reduction} of the {dp} dp replicas' losses" if dp > 1 else "")
    for name, t in leaves(x_ref, "input"):
        if t.grad is not None:
            add(name, "input_grad", [r.input_grads.get(name) for r in results], t.grad)
    return rows, notes


def _per_rank_loss(rows: list[GradRow], read_as: dict) -> None:
    """When the loss differs across ranks and an output held a local shard, the loss was
    computed per shard: say so on the loss row, and drop the "summed copies" notes that
    would point at a collective instead."""
    spread = next((r for r in rows if r["name"] == "loss" and r["kind"] == "replica_spread"),
                  None)
    if not read_as or spread is None or spread["ok"]:
        return
    names = ", ".join(f"{k} ({p})" for k, (p, _) in read_as.items())
    for i, r in enumerate(rows):
        if r is spread:
            rows[i] = replace(r, note=f"the loss differs across ranks: computed on each rank's "
                                      f"local shard of {names}? If the framework's trainer "
                                      f"reduces it, declare it with outputs={{'loss': "
                                      f"{RANK_LOCAL!r}}}")
        elif r.note.startswith("= ") and "collective" in r.note:
            rows[i] = replace(r, note="")
