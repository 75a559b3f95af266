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

import contextlib
import dataclasses
import inspect
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import DTensor, distribute_tensor

from tplab.core import placements
from tplab.core.fsdp_layout import managed, refuse_in_simulation, tp_view
from tplab.core.pairing import Pair
from tplab.core.pytrees import call_model, leaves, map_tensors
from tplab.core.rng_streams import rank_free_randomness
from tplab.layouts import ParamLayout, tp_layout
from tplab.losses import call_loss, loss_context
from tplab.mesh import MeshShape, split, tp_group
from tplab.rank.grad_step import replica_slice, sum_convention

LIVE_PREFIX = "\x1b[8m[tplab-train]"  # concealed: an old terminal shows nothing of it
LIVE_SUFFIX = "\x1b[0m"


@dataclasses.dataclass(frozen=True, eq=False)
class TrainResult:
    """What one rank's `train_on_ranks` hands the notebook (by pickle): `losses` (step),
    `batch_sums` (step, 2): the checksums of the batches the rank drew; `diffs` (step
    0..steps, pair of `TrainJob.pairs`): how far each local piece is from the reference's;
    `replicas`: {name: (step 0..steps, ...)} the copies of the parameters every rank of a
    group should hold alike."""

    losses: torch.Tensor
    batch_sums: torch.Tensor
    diffs: torch.Tensor
    replicas: dict[str, torch.Tensor]


def default_step(model, optimizer, batch, loss_fn=None, dp: int = 1,
                 dp_reduction: str = "mean"):
    """forward, loss (`loss_fn(output, batch)`, as grad_check's; under `loss_parallel()`
    when the logits are vocab-sharded DTensors), backward, `optimizer.step()`,
    `optimizer.zero_grad()`; returns the loss. `dp` > 1 (one device standing for dp
    replicas): the mean of the loss of each of the dp slices of dim 0, what the replicas'
    averaged gradients minimise (with a sum loss the whole batch's would be dp times it);
    their sum with `dp_reduction="sum"` (the replicas' gradients summed)."""
    out = call_model(model, batch)
    with loss_context(out):
        if dp > 1:
            loss = sum(call_loss(loss_fn, *map_tensors(lambda t, d=d: t.chunk(dp)[d],
                                                       (out, batch)))
                       for d in range(dp)) / (dp if dp_reduction == "mean" else 1)
        else:
            loss = call_loss(loss_fn, out, batch)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def make_training(make_optimizer, params):
    """(optimizer, scheduler or None) from `make_optimizer(params)`, which returns an
    optimizer or (optimizer, scheduler), as torch.optim.lr_scheduler's are made."""
    made = (make_optimizer or default_optimizer)(params)
    scheduler = None
    if isinstance(made, (tuple, list)):
        if len(made) != 2:
            raise TypeError(f"make_optimizer returned {len(made)} things; return an optimizer, "
                            "or (optimizer, scheduler)")
        made, scheduler = made
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"make_optimizer must return a torch.optim.Optimizer (or (optimizer, "
                        f"scheduler)); got {type(made).__name__}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"make_optimizer's scheduler must have a step() method; got "
                        f"{type(scheduler).__name__}")
    return made, scheduler


def step_scheduler(scheduler, loss) -> None:
    """After each training step, as a training loop does (ReduceLROnPlateau gets the loss)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(float(loss))
    else:
        scheduler.step()


def takes_step_number(make_batch) -> bool:
    """Whether `make_batch` is called as make_batch(i) (else make_batch(), the same batch
    every step, as grad_check's make_input)."""
    try:
        params = inspect.signature(make_batch).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


def batch_of(make_batch, i: int):
    """Step i's batch: make_batch(i), or make_batch() when it takes no step number."""
    return make_batch(i) if takes_step_number(make_batch) else make_batch()


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
    """A checksum of a batch: (float64 sum of its tensors, the same with every element
    weighted by its position), so that the same rows in another order are another batch."""
    total = torch.zeros(2, dtype=torch.float64)
    start = 0
    for _, t in leaves(batch, "batch"):
        flat = t.detach().double().reshape(-1)
        # weights 1 + frac(k * golden ratio): different at every position, exact to compute
        weights = 1 + torch.frac((torch.arange(flat.numel(), dtype=torch.float64) + start)
                                 * 0.6180339887498949)
        total = total + torch.stack([flat.sum(), (flat * weights).sum()])
        start += flat.numel()
    return total


def average_over_dp(model, mesh, dp_reduction: str = "mean") -> None:
    """DDP's gradient all-reduce, as hooks: each gradient averaged over the dp replicas as
    soon as backward has accumulated it (before the user's clipping and optimizer step);
    summed with `dp_reduction="sum"`. Not the parameters FSDP2 manages: FSDP2
    reduce-scatters and reduces those itself."""
    group = mesh.get_group("dp")
    dp = mesh["dp"].size() if dp_reduction == "mean" else 1
    fsdp = managed(model)

    def hook(p):
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=group)
        g.div_(dp)

    for p in model.parameters():
        if p.requires_grad and id(p) not in fsdp:
            p.register_post_accumulate_grad_hook(hook)


def expected_local(ref: torch.Tensor, pair: Pair, param, mesh) -> torch.Tensor:
    """This rank's piece of the reference tensor `ref`, laid out as the ranks' parameter
    (`param=None`: its TP piece, for FSDP2's shards of a hand-written TP piece)."""
    if isinstance(param, DTensor):
        return distribute_tensor(ref, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    dim = placements.shard_dim(pair.placement)
    if dim is None:
        return ref
    _, size, rank = tp_group(mesh)
    if pair.padded:
        pad = [0, 0] * (ref.ndim - dim - 1) + [0, pair.padded - ref.shape[dim]]
        ref = torch.nn.functional.pad(ref, pad)
    return split(ref, size, rank, dim)


def local_and_expected(param, pair: Pair, ref: torch.Tensor, mesh, piece: bool):
    """(this rank's piece of `param`, the same piece of the reference `ref`). `piece`: FSDP2
    sharded a hand-written TP piece (`ParamLayout.dp_placement`)."""
    if not piece:
        return layout_value(param), expected_local(ref, pair, param, mesh)
    if "tp" in (param.device_mesh.mesh_dim_names or ()):
        # FSDP2 given the tp dim over hand-written pieces: the TP piece it gathers for the
        # forward (a mixture of the tp ranks' pieces), all-gathered here
        return tp_view(param.detach()), expected_local(ref, pair, None, mesh)
    # FSDP2's shard of this rank's TP piece: no communication
    want = distribute_tensor(expected_local(ref, pair, None, mesh).contiguous(),
                             param.device_mesh, param.placements, src_data_rank=None)
    return layout_value(param), want.to_local()


def expected_pieces(param, pair: Pair, ref: torch.Tensor, mesh, piece: bool):
    """This rank's piece of the reference at every step, `[steps + 1, *local shape]`, cut
    once: the element indices that `local_and_expected` places (an index tensor cut as the
    reference would be: the same elements, exactly) taken from every step's reference.
    None where only the per-step path can do it (padded shards; FSDP2 given the tp dim,
    whose comparison gathers the ranks' own parameter; a Partial placement, whose pieces
    are not the reference's elements; tplab.simulate, whose ranks are one process)."""
    if pair.padded or enabled_local_tensor_mode() is not None:
        return None
    if isinstance(param, DTensor) and (any(pl.is_partial() for pl in param.placements) or (
            piece and "tp" in (param.device_mesh.mesh_dim_names or ()))):
        return None
    whole = torch.arange(ref[0].numel()).reshape(ref.shape[1:])
    _, index = local_and_expected(param, pair, whole, mesh, piece)
    return ref.reshape(ref.shape[0], -1)[:, index.reshape(-1)].reshape(-1, *index.shape)


def parameter_diff(param, pair: Pair, cut, ref: torch.Tensor, step: int, mesh,
                   piece: bool) -> torch.Tensor:
    """max |local piece - the reference's| of one parameter after `step` steps (`cut`: its
    `expected_pieces`, or None for the per-step path)."""
    if cut is not None:
        local, want = layout_value(param), cut[step]
    else:
        local, want = local_and_expected(param, pair, ref[step], mesh, piece)
    return (local.float() - want.float()).abs().max() if local.numel() else torch.zeros(())


def emit_live(step: int, loss, diffs: dict[str, torch.Tensor], rank: int) -> None:
    """One line per step for the notebook's live figure (see tplab/checks/train_live.py)."""
    record = {"rank": rank, "step": step, "loss": float(loss),
              "diff": max((float(d) for d in diffs.values()), default=0.0)}
    sys.stdout.write(f"{LIVE_PREFIX}{json.dumps(record)}{LIVE_SUFFIX}\n")
    sys.stdout.flush()


@dataclasses.dataclass(frozen=True, eq=False)
class TrainJob:
    """What train_check sends every rank (by pickle), made and checked in the notebook:
    the model's builder and initial weights, the plan (applied unchecked: checked in the
    notebook), the user's batches and step, the mesh shape, the one-device run
    (`reference`: its parameters of every step, or the path of a file holding them), the
    pairs of the ranks' parameters with it (made in the notebook from `layout_on_ranks`'
    answer, tplab.core.pairing), and the options: `context` (a factory of a context
    manager entered around each step), `dp_reduction` ("mean" or "sum"), `live`."""

    build_model: Callable
    state: dict
    plan: Callable
    make_batch: Callable
    steps: int
    step: Callable | None
    make_optimizer: Callable | None
    loss_fn: Callable | None
    mesh: MeshShape
    reference: object
    pairs: tuple[Pair, ...] = ()
    live: bool = False
    context: Callable | None = None
    dp_reduction: str = "mean"


def parallel_model(job: TrainJob, mesh):
    """Build, load the notebook's weights, parallelise: the model the ranks train."""
    model = job.build_model()
    model.load_state_dict(job.state)
    per_rank_parameters(model)
    model = job.plan(model, mesh)
    refuse_in_simulation(model)
    return model


def layout_on_ranks(job: TrainJob) -> dict[str, ParamLayout]:
    """Before training: the parallel model's parameters as `tp_layout` describes them (no
    values), which the notebook pairs with the reference's. Built under `fork_rng`, so
    that the global RNG the training draws from goes on as if this had not run."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        model = parallel_model(job, job.mesh.make())
        return {n: dataclasses.replace(i, value=None)
                for n, i in tp_layout(model, of="param").items()}


def train_on_ranks(job: TrainJob) -> TrainResult:
    """Rank side: build, load the notebook's weights, parallelise, then `steps` of the
    user's step; see the module doc. Returns losses, batch checksums, per-step parameter
    differences (one per pair of `job.pairs`) and the replicated parameters' copies."""
    mesh, dp = job.mesh.make(), job.mesh.dp
    reference = job.reference
    if isinstance(reference, str):
        reference = torch.load(reference, mmap=True, weights_only=True)
    model = parallel_model(job, mesh)
    if job.dp_reduction == "sum":
        sum_convention(model)
    if dp > 1:
        average_over_dp(model, mesh, job.dp_reduction)
    optimizer, scheduler = make_training(job.make_optimizer, model.parameters())
    described = {n: dataclasses.replace(i, value=None)
                 for n, i in tp_layout(model, of="param").items()}
    pairs = list(job.pairs)
    drift = Drift(model, pairs, described, reference, mesh, dp)
    losses, sums = [], []
    user_step = job.step or (lambda m, o, b: default_step(m, o, b, job.loss_fn))
    rank = dist.get_rank() if job.live else 0
    for i in range(job.steps):
        with rank_free_randomness():  # a seeded torch.Generator draws alike on every rank
            batch = batch_of(job.make_batch, i)
        sums.append(batch_sum(batch))
        if dp > 1:
            batch = map_tensors(lambda t: replica_slice(t, mesh), batch)
        with job.context() if job.context else contextlib.nullcontext():
            losses.append(plain_loss(user_step(model, optimizer, batch)))
        step_scheduler(scheduler, losses[-1])
        drift.measure(i + 1)
        if job.live:
            emit_live(i + 1, losses[-1], drift.diffs[-1], rank)
    names = [p.ranks for p in pairs]
    return TrainResult(
        torch.stack(losses) if losses else torch.zeros(0),
        torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64),
        torch.stack([torch.stack([d[n] for n in names]) if names else torch.zeros(0)
                     for d in drift.diffs]),
        {n: torch.stack(v) for n, v in drift.replicas.items()})


class Drift:
    """After each step, how far each paired parameter's local piece is from the reference's
    (`diffs`, one {name: max abs difference} per step from step 0), and the copies of the
    parameters every rank of a group should hold alike (`replicas`, for the spread)."""

    def __init__(self, model, pairs: list[Pair], described: dict[str, ParamLayout],
                 reference: dict, mesh, dp: int):
        self.params = dict(model.named_parameters())
        self.pairs, self.described, self.reference, self.mesh = pairs, described, reference, mesh
        # FSDP2's shards differ across dp by design: each rank's piece is compared with the
        # reference's piece instead (every element is held by some rank)
        self.copies = [p.ranks for p in pairs if (dp > 1 or not (
            placements.is_shard(p.placement) or placements.is_partial(p.placement)))
            and not described[p.ranks].fsdp and not p.whole_mesh]
        self.replicas: dict[str, list[torch.Tensor]] = {name: [] for name in self.copies}
        self.diffs: list[dict[str, torch.Tensor]] = []
        # every step's expected piece cut once (a DTensor's placing costs a millisecond a
        # parameter: per step, it was most of what train_check added to an FSDP2 x TP run)
        self.pieces = {p.ranks: expected_pieces(self.params[p.ranks], p, reference[p.ref], mesh,
                                                described[p.ranks].dp_placement is not None)
                       for p in pairs}
        self.measure(0)

    def measure(self, step: int) -> None:
        diffs = {p.ranks: parameter_diff(self.params[p.ranks], p, self.pieces[p.ranks],
                                         self.reference[p.ref], step, self.mesh,
                                         self.described[p.ranks].dp_placement is not None)
                 for p in self.pairs}
        for name in self.copies:
            self.replicas[name].append(layout_value(self.params[name]).clone())
        self.diffs.append(diffs)


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
