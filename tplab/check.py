"""grad_check: does the tensor-parallel model compute what the single-device model computes?

    report = tplab.grad_check(lab, build_model, plan, make_input, loss_fn=None)
    report = tplab.grad_check(lab, build_model, plan, make_input, dp=2, tp=2)  # 2-D

How the pieces are called (the same in processes and in `tplab.simulate`):
- `build_model()` takes no arguments. It is called once in the notebook for the reference,
  and once on every rank, which then loads the notebook model's initial weights (so the
  weights are identical even if build_model is not deterministic). The model is built
  whole; the plan splits it. By default the tp degree is the lab's world size (a 1-D mesh
  `make_mesh(tp=world_size)` made on the ranks).
- `make_input()` takes no arguments and is called ONCE, in the notebook; the tensor is sent
  to every rank (no rank-dependent randomness). A floating-point input gets
  requires_grad=True, so its gradient is checked too (integer token ids are not).
- `plan` is a dict for `tplab.apply_plan` or a callable `(model, mesh) -> model`
  (the hand-written path: `tplab.megatron.parallelize`).
- `dp=` and/or `tp=` (dp * tp = world size; give one and the other follows) check on a
  2-D mesh `make_mesh(dp=dp, tp=tp)`, data parallel over dp, tensor parallel within each
  tp group. `make_input()` then gives the WHOLE batch: dp replica d gets the d-th of dp
  equal slices of dim 0 (as a DistributedSampler would), so dim 0 must divide by dp. Each
  replica's loss is its slice's loss, and its parameter gradients are averaged over dp after
  backward (DDP's all-reduce; `average_dp=False` when the plan does that itself). The
  reference is the single-device model on the whole batch with the MEAN of the dp slices'
  losses, so every gradient it gives is the averaged one; the ranks' input gradients are
  divided by dp to match. Gradients that the plan made DTensors on the whole mesh (FSDP2)
  are taken as they are.
- `loss_fn(output, input) -> scalar` (or `loss_fn(output)`); default `0.5 * sum(output**2)`,
  whose gradient is the output itself. When the output is a DTensor sharded on its last dim
  (an lm head planned for loss parallelism), loss and backward run under `loss_parallel()`.

The report has one row per tensor: the output (and the loss), the input's gradient, every
parameter's gradient (assembled from the ranks' shards), and for every tensor that should
be the same on every rank, the spread across ranks (kind "replica_spread").
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass, field

import torch

from tplab.errors import LabError
from tplab.transfer import LocalShard

_WORDS = {"output": "{name} wrong", "input_grad": "input gradient wrong",
          "param_grad": "gradient of {name} wrong",
          "replica_spread": "{name} differs across ranks"}


def _call_loss(loss_fn, out, x):
    if loss_fn is None:
        return 0.5 * out.pow(2).sum()
    try:
        params = inspect.signature(loss_fn).parameters.values()
        two = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2
        two = two or any(p.kind is p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        two = True
    return loss_fn(out, x) if two else loss_fn(out)


def _loss_context(out):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    if isinstance(out, DTensor) and any(
            p.is_shard() and p.dim in (-1, out.ndim - 1) for p in out.placements):
        return loss_parallel()
    return contextlib.nullcontext()


def _parallel_step(build_model, state, plan, x, loss_fn, dp=1, average_dp=True):
    """Rank side: build, load the reference weights, parallelise, one forward and backward.
    With dp > 1 on a (dp, tp) mesh: this replica's slice of the batch (see module doc)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tplab.mesh import make_mesh
    from tplab.plans import apply_plan

    world = dist.get_world_size()
    mesh = make_mesh(tp=world) if dp == 1 else make_mesh(dp=dp, tp=world // dp)
    model = build_model()
    model.load_state_dict(state)
    model = apply_plan(model, mesh, plan) if isinstance(plan, dict) else plan(model, mesh)
    x = x.clone() if dp == 1 else _replica_slice(x, mesh)
    if x.is_floating_point():
        x.requires_grad_(True)
    out = model(x)  # may be an AsyncCollectiveTensor: its .wait() would cut the graph
    with _loss_context(out):
        loss = _call_loss(loss_fn, out, x)
        loss.backward()
    if dp > 1:
        return _on_whole_mesh(model, mesh, out, loss, x, average_dp)
    grads = {}
    for path, module in model.named_modules():
        # hand-written layers (tplab.megatron) hold plain local shards: say what they are
        placements = getattr(module, "tp_placements", {})
        for name, p in module.named_parameters(recurse=False):
            g = p.grad
            if g is not None and not isinstance(g, DTensor) and name in placements:
                g = DTensor.from_local(g, mesh, [placements[name]], run_check=False)
            grads[f"{path}.{name}" if path else name] = g
    return {"output": out, "loss": loss.detach(), "input_grad": x.grad, "grads": grads}


def _replica_slice(x, mesh):
    """Rank side: dp replica d's slice d of the batch (dim 0). index_select with a tensor
    index, not chunk: in tplab.simulate the dp coordinate holds every rank's value."""
    dp = mesh["dp"].size()
    n = x.shape[0] // dp
    return x.index_select(0, torch.arange(n, device=x.device) + mesh.get_local_rank("dp") * n)


def _on_whole_mesh(model, mesh, out, loss, x, average_dp):
    """Rank side, dp > 1: every result as a DTensor on the whole (dp, tp) mesh, so that the
    notebook places it (a DTensor on the tp sub-mesh would not say which dp replica holds
    it): outputs and input grads Shard(0) over dp, the loss Partial over dp (each replica
    holds loss_d / dp of the mean), parameter gradients Replicate over dp once averaged."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dp = mesh["dp"].size()

    def whole(t, over_dp, tp_placement=None):
        if t is None:
            return None
        if isinstance(t, DTensor):  # on the tp sub-mesh: one placement
            tp_placement, t = t.placements[-1], t.to_local()
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
        t = t.detach()
        if isinstance(tp_placement, Shard) and tp_placement.dim < 0:
            tp_placement = Shard(tp_placement.dim + t.ndim)
        return DTensor.from_local(t, mesh, [over_dp, tp_placement or Replicate()],
                                  run_check=False)

    grads = {}
    for path, module in model.named_modules():
        placements = getattr(module, "tp_placements", {})  # tplab.megatron's layers
        for name, p in module.named_parameters(recurse=False):
            g, key = p.grad, f"{path}.{name}" if path else name
            if isinstance(g, DTensor) and g.device_mesh.ndim > 1:
                grads[key] = g  # on the whole mesh already: the plan's own dp (FSDP2)
                continue
            place = placements.get(name)
            if isinstance(g, DTensor):
                place, g = g.placements[-1], g.to_local()
            if g is not None and average_dp:  # DDP: the mean over the dp replicas
                g = g.detach().clone()
                dist.all_reduce(g, group=mesh.get_group("dp"))
                g = g / dp
            grads[key] = whole(g, Replicate(), place)
    grad = None if x.grad is None else x.grad / dp
    return {"output": whole(out, Shard(0)), "loss": whole(loss / dp, Partial()),
            "input_grad": whole(grad, Shard(0)), "grads": grads}


def assemble(values: list) -> tuple[torch.Tensor | None, float | None]:
    """The whole tensor from the ranks' values, and the spread across its replicas.

    `values` holds one item per rank: a LocalShard (placed by its offsets; Partial shards
    summed) or a plain tensor (every rank should hold the same). The spread is the largest
    difference between copies that should be equal (None when nothing is replicated).
    """
    if any(v is None for v in values):
        return None, None
    if not isinstance(values[0], LocalShard):
        spread = max((float((v - values[0]).abs().max()) for v in values[1:]), default=None)
        return values[0], spread
    first = values[0]
    replicate = {i for i, p in enumerate(first.placements) if p == "Replicate()"}
    partial = any(p.startswith("Partial") for p in first.placements)
    groups: dict[tuple, list[LocalShard]] = {}
    for s in values:
        key = tuple(c for i, c in enumerate(s.coordinate) if i not in replicate)
        groups.setdefault(key, []).append(s)
    full = torch.zeros(first.global_shape, dtype=first.local.dtype)
    spread = None
    for copies in groups.values():
        s = copies[0]
        region = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.local.shape, strict=True))
        if partial:
            full[region] += s.local
        else:
            full[region] = s.local
        for other in copies[1:]:
            spread = max(spread or 0.0, float((other.local - s.local).abs().max()))
    return full, spread


def _row(name, kind, value, ref, atol, rtol, note=""):
    ref = ref.detach() if isinstance(ref, torch.Tensor) else ref
    scale = float(ref.abs().max()) if ref is not None and ref.numel() else 0.0
    if value is None or ref is None or (isinstance(value, torch.Tensor)
                                        and value.shape != ref.shape):
        note = note or ("missing" if value is None or ref is None else
                        f"shape {tuple(value.shape)} != reference {tuple(ref.shape)}")
        max_abs = math.inf
    elif isinstance(value, torch.Tensor):
        max_abs = float((value.double() - ref.double()).abs().max()) if ref.numel() else 0.0
    else:  # a spread, already a number
        max_abs = float(value)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return {"name": name, "kind": kind, "max_abs": max_abs, "max_rel": max_rel,
            "ok": max_abs <= atol + rtol * scale, "note": note}


@dataclass
class GradCheckReport:
    """Rows of {name, kind, max_abs, max_rel, ok, note}; `.ok` when every row is within
    atol + rtol * max|reference|."""

    rows: list[dict]
    world_size: int
    atol: float
    rtol: float
    loss: float = float("nan")
    mesh_shape: dict | None = None  # {"dp": 2, "tp": 2} for a 2-D check
    failures: list[dict] = field(init=False)

    def __post_init__(self):
        self.failures = [r for r in self.rows if not r["ok"]]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def max_abs(self) -> float:
        return max((r["max_abs"] for r in self.rows), default=0.0)

    def summary(self) -> str:
        shape = self.mesh_shape or {}
        on = f" (dp={shape['dp']} x tp={shape['tp']})" if shape.get("dp", 1) > 1 else ""
        head = (f"grad_check on {self.world_size} ranks{on} "
                f"(atol {self.atol:g}, rtol {self.rtol:g})")
        if self.ok:
            return f"{head}: ok, {len(self.rows)} tensors, max abs error {self.max_abs:.2e}"
        wrong = "; ".join(f"{_WORDS[r['kind']].format(name=r['name'])} "
                          f"(max abs {r['max_abs']:.2e}{', ' + r['note'] if r['note'] else ''})"
                          for r in self.failures)
        return f"{head}: FAILED: {wrong}"

    def _table(self, fmt: str) -> str:
        """The rows as a table; the note column only when some row has a note."""
        from tabulate import tabulate

        notes = any(r["note"] for r in self.rows)
        headers = ["tensor", "kind", "max abs", "max rel", "verdict"] + (["note"] if notes else [])
        cells = [[r["name"], r["kind"], f"{r['max_abs']:.2e}", f"{r['max_rel']:.2e}",
                  "ok" if r["ok"] else "WRONG"] + ([r["note"]] if notes else []) for r in self.rows]
        return tabulate(cells, headers=headers, tablefmt=fmt)

    def __str__(self) -> str:
        return f"{self.summary()}\n{self._table('simple')}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        table = self._table("html")
        colour = "green" if self.ok else "red"
        return f'<p style="color:{colour}">{self.summary()}</p>{table}'


def _mesh_shape(world: int, dp: int | None, tp: int | None) -> tuple[int, int]:
    """(dp, tp) from what was given: neither -> (1, world); one -> the other from world."""
    for name, size in (("dp", dp), ("tp", tp)):
        if size is not None and (not isinstance(size, int) or size < 1 or world % size):
            raise LabError(f"grad_check: {name}={size!r} must be a positive int that divides "
                           f"the world size {world}")
    if tp is None:
        tp = world // (dp or 1)
    dp = world // tp if dp is None else dp
    if dp * tp != world:
        raise LabError(f"grad_check: dp={dp} x tp={tp} = {dp * tp} ranks, but the lab has "
                       f"{world}")
    return dp, tp


def grad_check(lab, build_model, plan, make_input, loss_fn=None, atol: float = 1e-5,
               rtol: float = 1e-4, *, dp: int | None = None, tp: int | None = None,
               average_dp: bool = True) -> GradCheckReport:
    """Run the single-device reference here and the parallel model on `lab` (a Lab or a
    Simulation) with identical weights and input; compare output, input gradient and every
    parameter gradient. `dp`/`tp` check data x tensor parallelism on a 2-D mesh. See the
    module docstring for how the arguments are called."""
    dp, tp = _mesh_shape(lab.world_size, dp, tp)
    model = build_model()
    if isinstance(plan, dict):  # a PlanError here, before anything is sent to the ranks
        from tplab.plans import check_plan

        check_plan(model, plan, tp)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = make_input()
    x_ref = x.clone()
    if x_ref.is_floating_point():
        x_ref.requires_grad_(True)
    if dp == 1:
        out_ref = model(x_ref)
        loss_ref = _call_loss(loss_fn, out_ref, x_ref)
    else:  # the mean of the dp replicas' losses, each on its slice of the batch
        if x.ndim == 0 or x.shape[0] % dp:
            raise LabError(f"grad_check: dim 0 of the input (shape {tuple(x.shape)}) must "
                           f"divide into dp={dp} equal slices, one per data-parallel replica")
        parts = x_ref.chunk(dp)
        outs = [model(part) for part in parts]
        out_ref = torch.cat(outs)
        losses = [_call_loss(loss_fn, o, part) for o, part in zip(outs, parts, strict=True)]
        loss_ref = sum(losses) / dp
    loss_ref.backward()

    results = lab.run(_parallel_step, build_model, state, plan, x, loss_fn, dp, average_dp)
    rows: list[dict] = []

    def add(name, kind, values, ref, note=""):
        full, spread = assemble(values)
        if not note and isinstance(values[0], LocalShard) and any(
                p.startswith("Partial") for p in values[0].placements):
            note = "Partial on the ranks (not yet reduced); summed here"
        rows.append(_row(name, kind, full, ref, atol, rtol, note))
        if spread is not None:
            rows.append(_row(name, "replica_spread", spread, ref, atol, rtol))

    add("output", "output", [r["output"] for r in results], out_ref)
    add("loss", "output", [r["loss"] for r in results], loss_ref,
        f"the mean of the {dp} dp replicas' losses" if dp > 1 else "")
    if x_ref.grad is not None:
        add("input", "input_grad", [r["input_grad"] for r in results], x_ref.grad)
    for name, p in model.named_parameters():
        add(name, "param_grad", [r["grads"].get(name) for r in results], p.grad)
    return GradCheckReport(rows, len(results), atol, rtol, loss_ref.item(), {"dp": dp, "tp": tp})
