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
  the plan made DTensors on the whole mesh (FSDP2) are taken as they are.

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
"""

from __future__ import annotations

import dataclasses

import torch

from tplab import rng
from tplab.checks.grad_report import GradCheckReport, compare, unpaired, unreadable
from tplab.core import placements
from tplab.core.fsdp_layout import refuse_plan_in_simulation
from tplab.core.pairing import Pair, gather, gather_indexed, pair
from tplab.core.pytrees import call_model, leaves, map_tensors
from tplab.core.transfer import LocalShard
from tplab.errors import LabError
from tplab.fsdp_report import name_mesh_dims, replica_grads
from tplab.layouts import ParamLayout
from tplab.plans import parallelizer
from tplab.rank.grad_step import call_loss, parallel_step, with_grad

__all__ = ["TOLERANCES", "GradCheckReport", "assemble", "compare", "grad_check", "mesh_shape",
           "tensor_rows", "tolerances"]

# (atol, rtol) by the dtype the model computes in, as torch.testing.assert_close picks its
# defaults by dtype. float32's are grad_check's own (a TP run's gradients differ from one
# device's by about 16 ulps of the largest); the half types' keep about the same ratio to
# what their rounding makes (measured here: TinyLM, TP and DTensor plans, world 2: bfloat16
# up to 0.024 of the largest, float16 up to 0.004; every bug of the lessons is O(1)).
TOLERANCES = {torch.float64: (1e-5, 1e-4), torch.float32: (1e-5, 1e-4),
              torch.float16: (1e-4, 2e-2), torch.bfloat16: (1e-3, 1e-1)}


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
    replicate = {i for i, p in enumerate(first.placements) if placements.is_replicate(p)}
    partial = any(placements.is_partial(p) for p in first.placements)
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


def tensor_rows(name: str, kind: str, values: list, ref, atol: float, rtol: float,
                note: str = "") -> list[dict]:
    """The report's rows for one tensor from the ranks' values (one per rank): the
    assembled tensor against `ref`, and the spread across its replicas when it has any.
    What `grad_check` and the Explorer (tplab/widgets.py) both report."""
    full, spread = assemble(values)
    if not note and isinstance(values[0], LocalShard) and any(
            placements.is_partial(p) for p in values[0].placements):
        note = "Partial on the ranks (not yet reduced); summed here"
    rows = [compare(name, kind, full, ref, atol, rtol, note)]
    if spread is not None:
        rows.append(compare(name, "replica_spread", spread, ref, atol, rtol))
    return rows


def mesh_shape(world: int, dp: int | None, tp: int | None) -> tuple[int, int]:
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


def tolerances(tensors, atol: float | None, rtol: float | None):
    """(atol, rtol, dtype): those given, else TOLERANCES of the least precise floating dtype
    among `tensors` (the model's parameters and outputs: what it computes in)."""
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    default = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    return (default[0] if atol is None else atol, default[1] if rtol is None else rtol,
            dtype)


def _reference(model, x, loss_fn, dp):
    """The single-device step: (output leaves, loss, input with gradients)."""
    x_ref = with_grad(x)
    if dp == 1:
        out = call_model(model, x_ref)
        loss = call_loss(loss_fn, out, x_ref)
        outs = dict(leaves(out, "output"))
    else:  # the mean of the dp replicas' losses, each on its slice of the batch
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
                   for d in range(dp)) / dp
    loss.backward()
    return outs, loss, x_ref


def grad_check(lab, build_model, plan, make_input, loss_fn=None, atol: float | None = None,
               rtol: float | None = None, *, dp: int | None = None, tp: int | None = None,
               average_dp: bool = True, param_map: dict | None = None) -> GradCheckReport:
    """Run the single-device reference here and the parallel model on `lab` (a Lab or a
    Simulation) with identical weights and input; compare every output, input gradient
    and parameter gradient. `dp`/`tp` check data x tensor parallelism on a 2-D mesh;
    `param_map` pairs parameters by hand. See the module docstring."""
    dp, tp = mesh_shape(lab.world_size, dp, tp)
    if param_map is not None and not isinstance(param_map, dict):
        raise LabError("grad_check: param_map is a dict {parallel name: reference name} or "
                       "{parallel name: (reference name, shard dim or None)}")
    refuse_plan_in_simulation(plan, lab.in_process)  # FSDP2 under tplab.simulate
    model = build_model()
    x = make_input()
    parallelizer(plan, model, tp, x)  # a PlanError here, before anything reaches the ranks
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng.reference_tracker(model, tp)  # tplab.rng's "tp" masks drawn as the tp ranks draw them
    out_ref, loss_ref, x_ref = _reference(model, x, loss_fn, dp)
    atol, rtol, dtype = tolerances([*model.parameters(), *out_ref.values()], atol, rtol)
    results = lab.run(parallel_step, build_model, state, plan, x, loss_fn, dp, average_dp)
    rows: list[dict] = []

    def add(name, kind, values, ref, note=""):
        rows.extend(tensor_rows(name, kind, values, ref, atol, rtol, note))

    for name in [*out_ref, *(k for k in results[0].outputs if k not in out_ref)]:
        add(name, "output", [r.outputs.get(name) for r in results], out_ref.get(name))
    add("loss", "output", [r.loss for r in results], loss_ref,
        f"the mean of the {dp} dp replicas' losses" if dp > 1 else "")
    for name, t in leaves(x_ref, "input"):
        if t.grad is not None:
            add(name, "input_grad", [r.input_grads.get(name) for r in results], t.grad)
    wholes: dict = {}
    notes = _param_rows(model, results, tp, param_map, rows, atol, rtol, wholes)
    if dp > 1 and any(r["kind"] == "param_grad" and not r["ok"] for r in rows):
        # which mesh dim a wrong gradient comes from (tplab/fsdp_report.py)
        name_mesh_dims(rows, wholes, replica_grads(build_model, state, x, loss_fn, dp), dp,
                       atol, rtol)
    return GradCheckReport(rows, len(results), atol, rtol, loss_ref.item(),
                           {"dp": dp, "tp": tp}, notes, dtype=str(dtype).removeprefix("torch."))


def _param_rows(model, results, tp, param_map, rows, atol, rtol, wholes=None) -> list[str]:
    """Pair the ranks' parameters with the reference's; a row per pair (see tplab.core.pairing).
    `wholes` (a dict) gets each assembled gradient."""
    ref = dict(model.named_parameters())
    aliases = {n: ref_name for n, p in model.named_parameters(remove_duplicate=False)
               for ref_name, q in ref.items() if p is q and n != ref_name}
    buffers = [n for n, _ in model.named_buffers()]
    ranks = results[0].params
    pairs, lone_ranks, lone_ref, problems = pair({n: tuple(p.shape) for n, p in ref.items()},
                                                 ranks, tp, param_map, aliases)
    notes = []
    if buffers:
        notes.append(f"buffers are not compared (they get no gradient): {', '.join(buffers)}")
    by_ref: dict[str, list[Pair]] = {}
    for p in pairs:
        by_ref.setdefault(p.ref, []).append(p)
    frozen = []
    for name, p in ref.items():
        got = by_ref.get(name)
        if not got:
            continue
        if not p.requires_grad:
            frozen.append(name)
            continue
        new_rows, note = _grad_rows(name, p, got, results, tp, aliases, atol, rtol, wholes)
        rows.extend(new_rows)
        notes.extend([note] if note else [])
    if frozen:
        notes.append(f"need no gradient (requires_grad=False), not compared: "
                     f"{', '.join(frozen)}")
    rows.extend(_unpaired_rows(ref, ranks, lone_ranks, lone_ref, problems, notes))
    return notes


def _grad_rows(name, p, got: list[Pair], results, tp, aliases, atol, rtol, wholes):
    """(rows, note) for the reference parameter `name` (`p`) and the pairs on the ranks that
    hold it (more than one: tied in the reference, separate on the ranks). `wholes` (a dict,
    or None) gets the assembled gradient."""
    pieces = []
    for q in got:
        infos = [r.params[q.ranks] for r in results]
        why = next((i.unreadable for i in infos if i.unreadable), None)
        if why:  # never "wrong": tplab cannot read where each rank's elements lie
            return [unreadable(name, f"the layout on the ranks cannot be read ({why}); "
                                     "not checked")], None
        pieces.append(ASSEMBLERS[_placed_by(q, infos)](q, infos, p, tp))
    got = [q for q, _, _ in pieces]
    fulls = [full for _, full, _ in pieces]
    if p.grad is None and all(w is None for w in fulls):
        return [], f"{name}: no gradient on either side (not used by the loss)"
    full = None if any(w is None for w in fulls) else sum(fulls[1:], fulls[0])
    if wholes is not None:
        wholes[name] = full
    label, note = _pair_words(name, got, aliases)
    rows = [compare(name, "param_grad", full, p.grad, atol, rtol, note, label)]
    spread = max((s for _, _, s in pieces if s is not None), default=None)
    if spread is not None:
        rows.append(compare(name, "replica_spread", spread, p.grad, atol, rtol))
    return rows, None


def _placed_by(q: Pair, infos: list[ParamLayout]) -> str:
    """Which of ASSEMBLERS puts this pair's pieces together."""
    if q.placement == placements.MESH:
        return "mesh"
    if infos[0].index is not None:
        return "indexed"
    return "by placement"


def _on_whole_mesh(q: Pair, infos, p, tp):
    """A DTensor on the whole (dp, tp) mesh (FSDP2): placed by its LocalShards' offsets."""
    return (q, *assemble([i.value for i in infos]))


def _by_global_index(q: Pair, infos, p, tp):
    """A DTensor on the tp dim: placed as DTensor places it (`layouts.global_index`)."""
    return (q, *gather_indexed([i.value for i in infos], [i.index for i in infos],
                               tuple(p.shape), placements.is_partial(q.placement), tp))


def _by_placement(q: Pair, infos, p, tp):
    """A plain tensor with a placement declared or read from its shape (tplab.core.pairing)."""
    values = [i.value for i in infos]
    dim = placements.shard_dim(q.placement) or 0
    if placements.is_shard(q.placement) and values[0] is not None:
        # every rank's piece as long as rank 0's: a padded tensor (a vocabulary padded to a
        # multiple of tp), cut back to the reference's length
        length = sum(v.shape[dim] for v in values[:tp])
        q = dataclasses.replace(q, padded=length if length > p.shape[dim] else 0)
    return (q, *gather(values, q.placement or placements.REPLICATE, tp, q.padded,
                       p.shape[dim] if p.ndim else 0))


# how a pair's pieces become the whole gradient: (pair, whole, spread) by _placed_by's answer
ASSEMBLERS = {"mesh": _on_whole_mesh, "indexed": _by_global_index,
              "by placement": _by_placement}


def _pair_words(name: str, got: list[Pair], aliases: dict) -> tuple[str, str]:
    """(what the row says it was compared with on the ranks, its note)."""
    tied = [a for a, b in aliases.items() if b == name]
    label = "; ".join(q.placement if q.ranks == name else
                      f"{q.ranks} {q.placement} ({q.how})" for q in got)
    note = f"tied: also {', '.join(tied)}" if tied else ""
    if len(got) > 1:
        note = ("tied in the reference, separate on the ranks: their gradients are summed "
                "here, but an optimizer step would make the copies differ")
    if any(placements.is_partial(q.placement) for q in got):
        note = note or "Partial on the ranks (not yet reduced); summed here"
    if any(q.padded for q in got):
        note = note or f"padded to {got[0].padded} on the ranks; the padding is not compared"
    return label, note


def _unpaired_rows(ref, ranks, lone_ranks, lone_ref, problems, notes) -> list[dict]:
    """A row for each parameter that pairs with nothing (a note when it needs no
    gradient), saying how to pair it."""
    rows = []
    for name in lone_ranks:
        info = ranks[name]
        if not info.requires_grad:
            notes.append(f"{name} (only on the ranks) needs no gradient: not compared")
            continue
        why = problems.get(name) or (f"only on the ranks, local shape {info.shape}: no "
                                     "reference parameter left fits it by order and shape")
        hint = f"{lone_ref[0]!r}" if lone_ref else "'<reference name>'"
        rows.append(unpaired(name, f"{why}; pair it with param_map={{{name!r}: {hint}}}"))
    for name in lone_ref:
        if not ref[name].requires_grad:
            continue
        cands = ", ".join(lone_ranks) or "none"
        rows.append(unpaired(name, f"only in the reference, shape {tuple(ref[name].shape)}; "
                                   f"unpaired on the ranks: {cands}; pair with "
                                   f"param_map={{'<name on the ranks>': {name!r}}}"))
    return rows
