"""`tplab.train_check`: a whole training run under TP, step by step against one device.

    report = tplab.train_check(lab, build_model, plan, make_batch, steps=50,
                               step=None, make_optimizer=None, loss_fn=None)
    report.ok; report.first_bad_step; report.diverged; report.rows; report.figure()

- `build_model()` and `plan` as for `tplab.grad_check` (a dict, or `(model, mesh) -> model`);
  the ranks load the notebook model's initial weights. `dp=`/`tp=` train on a 2-D mesh:
  dp replica d gets slice d of dim 0 of each batch, and every gradient is averaged over
  dp as soon as backward made it (DDP's all-reduce, as hooks).
- `make_batch(i)` gives step i's batch, the same wherever it is called (the notebook and
  every rank call it; a checksum of each batch is compared).
- `step(model, optimizer, batch) -> loss` is the user's own step: forward, backward,
  clipping, `optimizer.step()`, `zero_grad()`. It runs unchanged on one device (the
  reference, in this process) and on the ranks. Without it, `loss_fn(output, batch)`
  (default: grad_check's) is minimised by a plain step.
- `make_optimizer(params)` builds the optimizer (default AdamW, lr 1e-3, weight decay 0.01).
- tplab.rng's dropout: the reference draws its "tp"-region masks as the ranks do
  (`rng.reference_tracker`), so a run with dropout is compared exactly too.

The band (tplab/training/band.py) is measured by running the reference a second time in
another reduction order (tplab/training/noise.py). `first_bad_step` is the first step
whose loss, parameter difference or replica spread is outside it; `diverged` says which
of the loss, a sharded parameter or a replicated one, worst first.

With `live=True` (the default in a Jupyter kernel, with a Lab) the figure is drawn while
the ranks train, from one line per step and rank that the ranks print through the lab's
live output path (tplab/training/live.py); elsewhere, and with `tplab.simulate`, it comes
at the end (`report.figure()`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
import uuid

import torch

from tplab import placements, rng
from tplab.check import mesh_shape
from tplab.errors import LabError
from tplab.lab.contract import Ranks
from tplab.pairing import gather
from tplab.plans import check_plan
from tplab.rank.train_step import (
    batch_sum,
    default_optimizer,
    default_step,
    plain_loss,
    train_on_ranks,
)
from tplab.training.band import FACTOR, noise_band
from tplab.training.live import LiveTraining, live_default
from tplab.training.noise import ReductionOrder
from tplab.training.report import WORDS, TrainReport


def run_reference(model, make_batch, steps, step, make_optimizer, loss_fn, order=None,
                  cancel: threading.Event | None = None):
    """One device: `steps` of the user's step on `model`. Returns (losses, {parameter name:
    [steps + 1, *shape] trajectory}, batch checksums). `cancel` (set by another thread)
    stops it between steps with a LabError."""
    optimizer = (make_optimizer or default_optimizer)(model.parameters())
    named = list(model.named_parameters())
    traj = {n: [p.detach().clone()] for n, p in named}
    losses, sums = [], []
    user_step = step or (lambda m, o, b: default_step(m, o, b, loss_fn))
    with order or contextlib.nullcontext():
        for i in range(steps):
            if cancel is not None and cancel.is_set():
                raise LabError("train_check: the one-device run was cancelled")
            batch = make_batch(i)
            sums.append(batch_sum(batch))
            losses.append(plain_loss(user_step(model, optimizer, batch)))
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


def _check_args(steps, make_batch, step, make_optimizer, loss_fn, build_model, live):
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"train_check: steps must be a positive int, got {steps!r}")
    for name, fn in (("build_model", build_model), ("make_batch", make_batch)):
        if not callable(fn):
            raise TypeError(f"train_check: {name} must be callable, got {fn!r}")
    for name, fn in (("step", step), ("make_optimizer", make_optimizer), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"train_check: {name} must be callable or None, got {fn!r}")
    if step is not None and loss_fn is not None:
        raise ValueError("train_check: loss_fn is for the default step; your step computes "
                         "its own loss (drop loss_fn=, or drop step=)")
    if live not in (None, True, False):
        raise TypeError(f"train_check: live must be True, False or None, got {live!r}")


def train_check(lab: Ranks, build_model, plan, make_batch, steps: int = 50, step=None,
                make_optimizer=None, loss_fn=None, *, dp: int | None = None,
                tp: int | None = None, param_map: dict | None = None,
                live: bool | None = None) -> TrainReport:
    """Train on the ranks of `lab` (a Lab or a Simulation) and on one device from the same
    weights, and compare them step by step against a measured noise band. See the module
    docstring."""
    _check_args(steps, make_batch, step, make_optimizer, loss_fn, build_model, live)
    if lab.closed:
        raise LabError("train_check: this lab was shut down; start a new one")
    dp, tp = mesh_shape(lab.world_size, dp, tp)
    if param_map is not None and not isinstance(param_map, dict):
        raise TypeError("train_check: param_map is a dict {parallel name: reference name}")
    model = build_model()
    if isinstance(plan, dict):
        check_plan(model, plan, tp)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    aliases = {n: ref for n, p in model.named_parameters(remove_duplicate=False)
               for ref, q in model.named_parameters() if p is q and n != ref}
    kinds = {n: p.requires_grad for n, p in model.named_parameters()}
    rng.reference_tracker(model, tp)
    twin = build_model()
    twin.load_state_dict(state)
    rng.reference_tracker(twin, tp)
    cancel = threading.Event()

    def measure_noise():
        noise_losses, noise, _ = run_reference(twin, make_batch, steps, step, make_optimizer,
                                               loss_fn, ReductionOrder(max(tp, 2)), cancel)
        return noise_band(ref_losses, noise_losses, ref, noise)

    with reference_threads(lab), concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref_losses, ref, ref_sums = run_reference(model, make_batch, steps, step,
                                                  make_optimizer, loss_fn)
        # The band's run needs nothing from the ranks, nor they from it: with rank
        # processes it runs in a thread of this process while they train (benchmarks/
        # train_check.py); a Simulation computes in this process, so it runs first.
        band = pool.submit(measure_noise)
        if lab.in_process:
            band.result()
        try:
            results = _train_ranks(lab, build_model, state, plan, make_batch, steps, step,
                                   make_optimizer, loss_fn, dp, param_map, ref, shapes,
                                   aliases, ref_losses, band, live)
        except BaseException:
            cancel.set()
            raise
        results, view = results
        band = band.result()
    report = _report(results, ref_losses, ref_sums, ref, band, dp, tp, lab.world_size, kinds)
    if view is not None:
        view.finish(report)
    return report


def _train_ranks(lab: Ranks, build_model, state, plan, make_batch, steps, step, make_optimizer,
                 loss_fn, dp, param_map, ref, shapes, aliases, ref_losses, band, live):
    """The ranks' run (tplab/rank/train_step.py), live or not; returns (results, view)."""
    live = live_default(lab) if live is None else live
    view = LiveTraining(lab.world_size, ref_losses, band) if live else None
    path = None
    source = ref
    if lab.shared_dir:
        path = os.path.join(lab.shared_dir, f"train-reference-{uuid.uuid4().hex}.pt")
        torch.save(ref, path)  # read by every local rank (mmap), not sent to each of them
        source = path
    try:
        with view.listening() if view else contextlib.nullcontext():
            results = lab.run(train_on_ranks, build_model, state, plan, make_batch, steps,
                              step, make_optimizer, loss_fn, dp, source, param_map,
                              {"shapes": shapes, "aliases": aliases}, bool(live))
    finally:
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)
    return results, view


def _report(results, ref_losses, ref_sums, ref, band, dp, tp, world, requires_grad):
    for r, res in enumerate(results):
        bad = (res["batch_sums"] != ref_sums).nonzero()
        if len(bad):
            i = int(bad[0])
            raise LabError(f"train_check: make_batch({i}) gave rank {r} another batch than "
                           "the notebook: it must give the same batch wherever it is called "
                           "(no rank-dependent randomness, no state between calls)")
    first = results[0]
    pairs = first["pairs"]
    names = [p["ranks"] for p in pairs]
    sharded = {p["ranks"]: placements.is_shard(p["placement"]) for p in pairs}
    diffs = torch.stack([res["diffs"] for res in results])  # rank, step, parameter
    steps = len(ref_losses)
    losses = torch.stack([res["losses"] for res in results])  # rank, step
    notes = [f"{n}: {why}" for n, why in first["problems"].items()]
    lone = [n for n in first["lone_ref"] if requires_grad.get(n, True)]
    unpaired = first["lone_ranks"] + lone
    spreads = _spreads(results, pairs, ref, tp, steps)
    rows = []
    for i in range(steps + 1):
        d = diffs[:, i, :] if names else torch.zeros(world, 1)
        worst = d.amax(0)
        k = int(worst.argmax()) if names else 0
        row = {"step": i, "param_diff": float(worst.max()) if names else 0.0,
               "param": names[k] if names else "", "param_band": band["param"][i],
               "replica_spread": spreads[i][0], "spread_param": spreads[i][1],
               "by_kind": {kind: max(((float(worst[j]), n) for j, n in enumerate(names)
                                      if sharded[n] == (kind == "sharded")), default=(0.0, ""))
                           for kind in ("sharded", "replicated")}}
        if i:
            per_replica = losses[:, i - 1].reshape(dp, tp)
            mean = float(per_replica[:, 0].double().mean())
            within = float((per_replica - per_replica[:, :1]).abs().max())
            row.update(ref_loss=float(ref_losses[i - 1]), losses=losses[:, i - 1].tolist(),
                       loss_diff=max(abs(mean - float(ref_losses[i - 1])), within),
                       loss_band=band["loss"][i - 1])
        else:
            row.update(ref_loss=math.nan, losses=[], loss_diff=0.0, loss_band=0.0)
        if row["replica_spread"] > row["by_kind"]["replicated"][0]:
            row["by_kind"]["replicated"] = (row["replica_spread"], row["spread_param"])
        row["ok"] = (row["loss_diff"] <= row["loss_band"] and row["param_diff"] <=
                     row["param_band"] and row["replica_spread"] <= row["param_band"])
        rows.append(row)
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
        report.diverged, report.detail = _diverged(bad)
    return report


def _spreads(results, pairs, ref, tp, steps) -> list[tuple[float, str]]:
    """Per step: the largest spread between copies that should be equal, and whose."""
    out = [(0.0, "")] * (steps + 1)
    for p in pairs:
        if p["ranks"] not in results[0]["replicas"]:
            continue
        values = [res["replicas"][p["ranks"]] for res in results]
        dim = placements.shard_dim(p["placement"]) or 0
        ref_len = ref[p["ref"]].shape[dim] if ref[p["ref"]].ndim else 0
        for i in range(steps + 1):
            _, spread = gather([v[i] for v in values], p["placement"] or placements.REPLICATE, tp,
                               p["padded"], ref_len)
            if spread is not None and spread > out[i][0]:
                out[i] = (spread, p["ranks"])
    return out




def _diverged(row) -> tuple[list[str], str]:
    ratios = {}
    if row["loss_diff"] > row["loss_band"]:
        ratios["loss"] = row["loss_diff"] / max(row["loss_band"], 1e-30)
    for kind in ("sharded", "replicated"):
        if row["by_kind"][kind][0] > row["param_band"]:
            ratios[kind] = row["by_kind"][kind][0] / max(row["param_band"], 1e-30)
    kinds = sorted(ratios, key=ratios.get, reverse=True)
    if not kinds:  # cannot happen: a row is bad because something is outside its band
        kinds = ["loss"]
    parts = []
    for kind in kinds:
        if kind == "loss":
            parts.append(f"the loss differs from one device's by {row['loss_diff']:.3g} "
                         f"(band {row['loss_band']:.2g})")
        elif kind == "replicated" and row["replica_spread"] > row["param_band"]:
            parts.append(f"a replicated parameter, {row['spread_param']}, differs across "
                         f"ranks by {row['replica_spread']:.3g} (band {row['param_band']:.2g})")
        else:
            value, name = row["by_kind"][kind]
            parts.append(f"{WORDS[kind]}, {name}, drifted from one device's by {value:.3g} "
                         f"(band {row['param_band']:.2g})")
    what = WORDS[kinds[0]]
    step = row["step"]
    head = (f"{what} diverged first, at step {step}" if step else
            "the ranks' initial weights differ from the notebook's (step 0)")
    return kinds, f"{head}: " + "; ".join(parts)


def _noise_words(band, tp) -> str:
    last = band["param_noise"][-1]
    return (f"noise band: {FACTOR:g} x the drift of one device's run with every matrix "
            f"product summed as {max(tp, 2)} partial sums in reverse order (by the last step "
            f"{last:.2g} in the parameters), plus a few ulps")

