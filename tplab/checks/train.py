"""`tplab.train_check`: a whole training run under TP, step by step against one device.

    report = tplab.train_check(lab, build_model, plan, make_batch, steps=50,
                               step=None, make_optimizer=None, loss_fn=None)
    report.ok; report.first_bad_step; report.diverged; report.rows; report.figure()

- `build_model()` and `plan` as for `tplab.grad_check` (a dict, or `(model, mesh) -> model`);
  the ranks load the notebook model's initial weights. `dp=`/`tp=` train on a 2-D mesh:
  dp replica d gets slice d of dim 0 of each batch, and every gradient is averaged over
  dp as soon as backward made it (DDP's all-reduce, as hooks).
- `make_batch(i)` gives step i's batch, the same wherever it is called (the notebook and
  every rank call it; a checksum of each batch, order included, is compared). Draw from a
  generator of its own (`torch.Generator().manual_seed(i)`); on simulated ranks it is
  called with rank-dependent randomness off. A `make_batch()` of no arguments gives the
  same batch every step.
- `step(model, optimizer, batch) -> loss` is the user's own step: forward, backward,
  clipping, `optimizer.step()`, `zero_grad()`. It runs unchanged on one device (the
  reference, in this process) and on the ranks. Without it, `loss_fn(output, batch)`
  (default: grad_check's) is minimised by a plain step. With dp > 1 the reference's loss is
  the mean of the dp slices' losses, as the replicas' averaged gradients minimise (your own
  step sees the whole batch on one device: give it a loss that is a mean over the batch).
- `make_optimizer(params)` builds the optimizer (default AdamW, lr 1e-3, weight decay 0.01),
  or returns (optimizer, scheduler): the scheduler is stepped after every step, on both.
- `context=` (a function of no arguments returning a context manager) is entered on every
  rank around each call of the step; `dp_reduction="sum"` (torchtitan's convention: the
  replicas' gradients summed, the loss divided by the global token count by loss_fn or the
  step) makes the reference's loss the sum of the dp slices' losses. As grad_check's.
- tplab.rng's dropout: the reference draws its "tp"-region masks as the ranks do
  (`rng.reference_tracker`), so a run with dropout is compared exactly too.

The band (tplab/checks/train_band.py) is measured by running the reference a second time with
every matrix product, forward and backward, summed in another order (tplab/training/
noise.py, `ReorderedProducts`): from the same weights, the same batches and the same
global RNG state (so torch's own nn.Dropout draws the same masks), so that it differs from
the first run by rounding alone, and by whatever the optimizer makes of rounding.
`first_bad_step` is the first step whose loss, parameter difference or replica spread is
outside it; `diverged` says which of the loss, a sharded parameter or a replicated one,
worst first. Every step's one-device parameters are kept (the ranks compare with each):
a run that would keep more than MEMORY_LIMIT bytes (train_args.py) is refused before it starts.

With `live=True` (the default in a Jupyter kernel, with a Lab) the figure is drawn while
the ranks train, from one line per step and rank that the ranks print through the lab's
live output path (tplab/checks/train_live.py); elsewhere, and with `tplab.simulate`, it comes
at the end (`report.figure()`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import threading
import uuid

import torch

from tplab import rng
from tplab.checks.grad import state_of
from tplab.checks.train_args import (
    bound_memory,
    check_args,
    check_options,
    refuse_non_finite,
    refuse_torch_dropout,
)
from tplab.checks.train_band import FACTOR, noise_band
from tplab.checks.train_live import LiveTraining, live_default
from tplab.checks.train_report import TrainReport, TrainRow, diverged
from tplab.core import placements
from tplab.core.fsdp_layout import refuse_plan_in_simulation
from tplab.core.pairing import Pair, gather, pair
from tplab.core.pytrees import map_tensors
from tplab.errors import LabError
from tplab.lab.contract import Ranks
from tplab.mesh import MeshShape
from tplab.plan_check import check_at_first_call
from tplab.plans import apply_plan, parallelizer
from tplab.rank.train_step import (
    TrainJob,
    batch_of,
    batch_sum,
    default_step,
    layout_on_ranks,
    make_training,
    plain_loss,
    step_scheduler,
    train_on_ranks,
)
from tplab.training.noise import ReorderedProducts


def run_reference(model, make_batch, steps, step, make_optimizer, loss_fn, order=None,
                  cancel: threading.Event | None = None, *, dp: int = 1,
                  batches: list | None = None, dp_reduction: str = "mean"):
    """One device: `steps` of the user's step on `model`. Returns (losses, {parameter name:
    [steps + 1, *shape] trajectory}, batch checksums). `cancel` (set by another thread)
    stops it between steps with a LabError. `dp`: the default step's loss is the mean of
    the dp slices' (as the replicas' averaged gradients make it). `batches`: an empty list
    records each step's batch into it; a filled one is replayed: the band's run trains on
    the very batches of the run it judges, and still calls make_batch as that run did, so
    that the global RNG (a make_batch drawing from it, nn.Dropout's masks) goes alike."""
    optimizer, scheduler = make_training(make_optimizer, model.parameters())
    named = list(model.named_parameters())
    traj = {n: [p.detach().clone()] for n, p in named}
    losses, sums = [], []
    user_step = step or (lambda m, o, b: default_step(m, o, b, loss_fn, dp, dp_reduction))
    replay = bool(batches)
    with order or contextlib.nullcontext():
        for i in range(steps):
            if cancel is not None and cancel.is_set():
                raise LabError("train_check: the one-device run was cancelled")
            batch = batch_of(make_batch, i)
            batch = batches[i] if replay else batch
            if batches is not None and not replay:
                batches.append(map_tensors(lambda t: t.clone(), batch))  # a step may edit it
            sums.append(batch_sum(batch))
            losses.append(plain_loss(user_step(model, optimizer, batch)))
            step_scheduler(scheduler, losses[-1])
            for n, p in named:
                traj[n].append(p.detach().clone())
    return torch.stack(losses), {n: torch.stack(v) for n, v in traj.items()}, torch.stack(sums)


@contextlib.contextmanager
def reference_threads(lab: Ranks):
    """The reference runs with one rank's share of the cores (`lab.threads_per_rank`): the
    ranks and the notebook share the machine, and torch's default (every core) in this
    process made each tiny op of the reference wait for its thread pool (measured here, 2
    cores, 4 ranks: 77 ms a step with 2 threads, 20 ms with 1)."""
    threads = lab.threads_per_rank
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _describe(model):
    """(weights, {name: shape}, {tied name: the name it shares}, {name: requires_grad})."""
    state = state_of(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    aliases = {n: ref for n, p in model.named_parameters(remove_duplicate=False)
               for ref, q in model.named_parameters() if p is q and n != ref}
    return state, shapes, aliases, {n: p.requires_grad for n, p in model.named_parameters()}


def train_check(lab: Ranks, build_model, plan, make_batch, steps: int = 50, step=None,
                make_optimizer=None, loss_fn=None, *, dp: int | None = None,
                tp: int | None = None, param_map: dict | None = None,
                live: bool | None = None, context=None,
                dp_reduction: str = "mean") -> TrainReport:
    """Train on the ranks of `lab` (a Lab or a Simulation) and on one device from the same
    weights, compared step by step against a measured noise band. `context` (entered around
    each step on the ranks) and `dp_reduction` as grad_check's; see the module doc."""
    check_args(lab, steps, make_batch, step, make_optimizer, loss_fn, build_model, live)
    check_options(context, dp_reduction, param_map)
    refuse_plan_in_simulation(plan, lab.in_process)  # FSDP2 under tplab.simulate
    shape = MeshShape.of(lab.world_size, dp, tp, who="train_check")
    dp, tp = shape.dp, shape.tp
    model = build_model()
    bound_memory(model, steps)
    refuse_torch_dropout(lab, model)
    step_plan = _checked_plan(plan, model, tp)
    state, shapes, aliases, kinds = _describe(model)
    rng.reference_tracker(model, tp)
    twin = _twin(build_model, state, tp)
    cancel, batches = threading.Event(), []
    start = torch.get_rng_state()  # nn.Dropout's masks: the band's run draws them again

    def measure_noise():
        torch.set_rng_state(start)
        noise_losses, noise, _ = run_reference(twin, make_batch, steps, step, make_optimizer,
                                               loss_fn, ReorderedProducts(max(tp, 2)), cancel,
                                               dp=dp, batches=batches,
                                               dp_reduction=dp_reduction)
        return noise_band(ref_losses, noise_losses, ref, noise)

    with reference_threads(lab), concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref_losses, ref, ref_sums = run_reference(model, make_batch, steps, step,
                                                  make_optimizer, loss_fn, dp=dp,
                                                  batches=batches, dp_reduction=dp_reduction)
        end = torch.get_rng_state()
        refuse_non_finite(ref_losses)
        # The band's run needs nothing from the ranks, nor they from it: with rank
        # processes it runs in a thread of this process while they train (benchmarks/
        # train_check.py); a Simulation computes in this process, so it runs first.
        band = pool.submit(measure_noise)
        if lab.in_process:
            band.result()
            torch.set_rng_state(end)  # where the ranks' global RNG goes on from
        job = TrainJob(build_model, state, step_plan, make_batch, steps, step, make_optimizer,
                       loss_fn, shape, ref, context=context, dp_reduction=dp_reduction)
        try:
            job, paired = _pair(lab, job, shapes, param_map, aliases)
            results, view = _train_ranks(lab, job, ref_losses, band, live)
        except BaseException:
            cancel.set()
            raise
        band = band.result()
        torch.set_rng_state(end)
    report = _report(results, paired, ref_losses, ref_sums, ref, band, job, lab.world_size,
                     kinds)
    if view is not None:
        view.finish(report)
    return report


@dataclasses.dataclass(frozen=True)
class Paired:
    """tplab.core.pairing's answer for the ranks' parameters (rank 0's layouts), made here
    as grad_check makes it: the pairs, what paired with nothing on either side, why a
    pairing asked for did not fit."""

    pairs: list[Pair]
    lone_ranks: list[str]
    lone_ref: list[str]
    problems: dict[str, str]


def _pair(lab: Ranks, job: TrainJob, shapes, param_map, aliases) -> tuple[TrainJob, Paired]:
    """Pair the ranks' parameters (their layouts: `layout_on_ranks`) with the reference's;
    (the job carrying the pairs to the ranks, the pairing)."""
    layout = lab.run(layout_on_ranks, job)[0]
    paired = Paired(*pair(shapes, layout, job.mesh.tp, param_map, aliases))
    return dataclasses.replace(job, pairs=tuple(paired.pairs)), paired


def _checked_plan(plan, model, tp: int):
    """The plan checked here once, a PlanError before the ranks run (a dict's layouts at
    the one-device reference's first call); the `(model, mesh) -> model` the ranks apply
    unchecked."""
    step_plan = parallelizer(plan, model, tp)
    if not isinstance(plan, dict):
        return step_plan
    check_at_first_call(model, plan)
    return functools.partial(apply_plan, plan=plan, checked="layouts")


def _twin(build_model, state: dict, tp: int):
    """The band's one-device model: the reference's weights and dropout streams."""
    twin = build_model()
    twin.load_state_dict(state)
    rng.reference_tracker(twin, tp)
    return twin


def _train_ranks(lab: Ranks, job: TrainJob, ref_losses, band, live):
    """The ranks' run (tplab/rank/train_step.py), live or not; returns (results, view)."""
    live = live_default(lab) if live is None else live
    view = LiveTraining(lab.world_size, ref_losses, band) if live else None
    path = None
    if lab.shared_dir:
        path = os.path.join(lab.shared_dir, f"train-reference-{uuid.uuid4().hex}.pt")
        torch.save(job.reference, path)  # read by every local rank (mmap), not sent to each
        job = dataclasses.replace(job, reference=path)
    job = dataclasses.replace(job, live=bool(live))
    try:
        with view.listening() if view else contextlib.nullcontext():
            results = lab.run(train_on_ranks, job)
    finally:
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)
    return results, view


def _report(results, paired: Paired, ref_losses, ref_sums, ref, band, job: TrainJob, world,
            requires_grad):
    _check_batches(results, ref_sums)
    dp, tp = job.mesh.dp, job.mesh.tp
    pairs = paired.pairs
    names = [p.ranks for p in pairs]
    sharded = {p.ranks: placements.is_shard(p.placement) for p in pairs}
    diffs = torch.stack([res.diffs for res in results])  # rank, step, parameter
    steps = len(ref_losses)
    losses = torch.stack([res.losses for res in results])  # rank, step
    notes = [f"{n}: {why}" for n, why in paired.problems.items()]
    lone = [n for n in paired.lone_ref if requires_grad.get(n, True)]
    unpaired = paired.lone_ranks + lone
    spreads = _spreads(results, pairs, ref, tp, steps)
    rows = []
    for i in range(steps + 1):
        d = diffs[:, i, :] if names else torch.zeros(world, 1)
        row = _param_row(i, d.amax(0), names, sharded, band, spreads[i])
        if i:
            per_replica = losses[:, i - 1].reshape(dp, tp)
            # the replicas' losses as the one-device run takes them: their mean, or their
            # sum (dp_reduction="sum": each divided by the global count already)
            mean = float(per_replica[:, 0].double().mean() if job.dp_reduction == "mean"
                         else per_replica[:, 0].double().sum())
            within = float((per_replica - per_replica[:, :1]).abs().max())
            row.update(ref_loss=float(ref_losses[i - 1]), losses=losses[:, i - 1].tolist(),
                       loss_diff=max(abs(mean - float(ref_losses[i - 1])), within),
                       loss_band=band["loss"][i - 1])
        else:
            row.update(ref_loss=math.nan, losses=[], loss_diff=0.0, loss_band=0.0)
        ok = (row["loss_diff"] <= row["loss_band"] and row["param_diff"] <= row["param_band"]
              and row["replica_spread"] <= row["param_band"])
        rows.append(TrainRow(**row, ok=ok))
    report = TrainReport(rows[1:], world, {"dp": dp, "tp": tp} if dp > 1 else {"tp": tp},
                         noise=_noise_words(band, tp), notes=notes)
    if unpaired:
        report.first_bad_step, report.diverged = 0, ["unpaired"]
        report.detail = (f"parameters that pair with nothing were not compared: "
                         f"{', '.join(unpaired)} (pair them with param_map=)")
        return report
    bad = next((r for r in rows if not r["ok"]), None)
    if bad is not None:
        report.first_bad_step = bad["step"]
        report.diverged, report.detail = diverged(bad)
    return report


def _check_batches(results, ref_sums) -> None:
    """A LabError when a rank drew other batches than the notebook (by their checksums)."""
    for r, res in enumerate(results):
        bad = (res.batch_sums != ref_sums).any(-1).nonzero()
        if len(bad):
            i = int(bad[0])
            same = bool(res.batch_sums[i, 0] == ref_sums[i, 0])
            what = ("the same values in another order (the same rows, shuffled per rank?)"
                    if same else "another batch")
            raise LabError(f"train_check: make_batch({i}) gave rank {r} {what} than the "
                           "notebook: it must give the same batch wherever it is called. "
                           "Draw from a generator of its own, torch.Generator()."
                           "manual_seed(i), not the global RNG (torch.randint(...) with no "
                           "generator=), and keep no state between calls")


def _param_row(i: int, worst, names, sharded, band, spread) -> dict:
    """Step i's row, its parameter part: the largest drift (`worst`: per parameter, over the
    ranks), whose, by kind, and the replica spread (`spread`: (value, whose))."""
    k = int(worst.argmax()) if names else 0
    row = {"step": i, "param_diff": float(worst.max()) if names else 0.0,
           "param": names[k] if names else "", "param_band": band["param"][i],
           "replica_spread": spread[0], "spread_param": spread[1],
           "by_kind": {kind: max(((float(worst[j]), n) for j, n in enumerate(names)
                                  if sharded[n] == (kind == "sharded")), default=(0.0, ""))
                       for kind in ("sharded", "replicated")}}
    if row["replica_spread"] > row["by_kind"]["replicated"][0]:
        row["by_kind"]["replicated"] = (row["replica_spread"], row["spread_param"])
    return row


def _spreads(results, pairs, ref, tp, steps) -> list[tuple[float, str]]:
    """Per step: the largest spread between copies that should be equal, and whose."""
    out = [(0.0, "")] * (steps + 1)
    for p in pairs:
        if p.ranks not in results[0].replicas:
            continue
        values = [res.replicas[p.ranks] for res in results]
        dim = placements.shard_dim(p.placement) or 0
        ref_len = ref[p.ref].shape[dim] if ref[p.ref].ndim else 0
        for i in range(steps + 1):
            _, spread = gather([v[i] for v in values], p.placement or placements.REPLICATE, tp,
                               p.padded, ref_len)
            if spread is not None and spread > out[i][0]:
                out[i] = (spread, p.ranks)
    return out


def _noise_words(band, tp) -> str:
    last = band["param_noise"][-1]
    return (f"noise band: {FACTOR:g} x the drift of one device's run with every matrix "
            f"product, forward and backward, summed as {max(tp, 2)} partial sums in reverse "
            f"order, from the same batches and masks (by the last step {last:.2g} in the "
            f"parameters), plus a few ulps")

