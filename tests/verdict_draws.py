"""Random small models, plans and training steps, correct or with a bug planted, and an
independent one-device truth for each: what tests/test_verdicts.py and benchmarks/verdicts.py
draw (issue 27).

A draw is a residual MLP (a replicated input layer, 1-2 `tplab.models.MLP` blocks,
optionally `tplab.rng.Dropout` on the residual stream, a replicated head), a plan
(hand-written Megatron, DTensor, or DTensor with gathered outputs), a world size (2 or 4),
dp (1 or 2 where the world allows), an optimizer, a step and a loss, and maybe one bug from
BUGS. The truth does not look at the label: it runs the same parallel model on the ranks
with plain torch (no tplab check code), takes every rank's local pieces, and compares them
with a plain one-device run (torch only) cut the same way. "bad" when they differ by far
more than rounding, "ok" when by rounding only, "unclear" in between (not counted).
"""

from __future__ import annotations

import dataclasses
import functools
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import tplab
from tplab import megatron, models, rng
from tplab.megatron import RowParallelLinear
from tplab.rank.grad_step import replica_slice
from tplab.rank.train_step import per_rank_parameters

DEBUG = False
BUGS = ("f omitted", "g omitted", "wrong style", "dropout masks differ per rank",
        "missing dp all-reduce", "wrong batch slicing")
DP_BUGS = ("missing dp all-reduce", "wrong batch slicing")


class Net(nn.Module):
    """x -> inp -> [h + dropout(MLP(h))] * blocks -> head; weights from `seed`."""

    def __init__(self, d: int, hidden: int, blocks: int, dropout: str | None, seed: int):
        super().__init__()
        cfg = models.Config(dim=d, hidden_dim=hidden, seed=seed)
        with rng.rank_free_randomness():
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(models.MLP(cfg) for _ in range(blocks))
            self.head = nn.Linear(d, 3)
        self.drop = None if dropout is None else rng.Dropout(0.2, dropout,
                                                             rng.RNGTracker(None, seed))
        models.init_weights(self, seed)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            y = block(h)
            h = h + (y if self.drop is None else self.drop(y))
        return self.head(h)


def _dtensor_plan(blocks: int, gathered: bool, wrong: bool) -> dict:
    plan = {}
    for b in range(blocks):
        if gathered:  # unusual, but right: every output gathered
            plan[f"blocks.{b}.w1"] = ColwiseParallel(output_layouts=Replicate())
            plan[f"blocks.{b}.w2"] = ColwiseParallel(output_layouts=Replicate())
        else:
            plan[f"blocks.{b}.w1"] = ColwiseParallel()
            plan[f"blocks.{b}.w2"] = ColwiseParallel() if wrong else RowwiseParallel()
    return plan


def _row_without_g(self, x):
    return F.linear(x, self.weight, self.bias)  # no all-reduce of the partial sums


def megatron_without_g(model, mesh):
    model = megatron.parallelize(model, mesh)
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            m.forward = functools.partial(_row_without_g, m)
    return model


def dict_plan(plan: dict):
    """A dict plan applied by torch itself (tplab's validation stays out of the truth)."""
    return functools.partial(_parallelize_module, plan=plan)


def _parallelize_module(model, mesh, plan):
    return parallelize_module(model, mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else
                              mesh, plan)


def batch_for(d: int, b: int, seed: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + i)
    with rng.rank_free_randomness():
        return torch.randn(b, 3, d, generator=g)


def mean_loss(out, batch):
    return out.pow(2).mean()


def mean_step(model, optimizer, batch):
    loss = mean_loss(model(batch), batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def half_batch_step(model, optimizer, batch):
    """The bug: trains on the first half of the batch it gets (a replica's slice on dp)."""
    return mean_step(model, optimizer, batch[: batch.shape[0] // 2])


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def sgd_scheduled(params):
    opt = torch.optim.SGD(params, lr=0.05)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


OPTIMIZERS = {"adamw": None, "sgd": sgd, "sgd+scheduler": sgd_scheduled}


@dataclasses.dataclass
class Draw:
    seed: int
    check: str  # "grad" or "train"
    world: int
    dp: int
    d: int
    hidden: int
    blocks: int
    dropout: bool
    plan_kind: str  # "megatron", "dtensor", "gathered"
    bug: str | None
    optimizer: str
    user_step: bool
    loss: str  # "default" (0.5 sum out^2) or "mean"
    steps: int

    @property
    def tp(self) -> int:
        return self.world // self.dp

    def build(self):
        region = None
        if self.dropout:
            region = "tp" if self.bug == "dropout masks differ per rank" else "replicated"
        return functools.partial(Net, self.d, self.hidden, self.blocks, region, self.seed)

    def plan(self):
        if self.plan_kind == "megatron":
            inner = {"f omitted": functools.partial(megatron.parallelize, reduce_grad=False),
                     "g omitted": megatron_without_g}.get(self.bug, megatron.parallelize)
        else:
            inner = _dtensor_plan(self.blocks, self.plan_kind == "gathered",
                                  self.bug == "wrong style")
        if self.dropout:
            return functools.partial(rng.parallelize, plan=inner, seed=None)
        return inner

    def make_batch(self):
        return functools.partial(batch_for, self.d, 4, self.seed)

    def step(self):
        if not self.user_step:
            return None
        return half_batch_step if self.bug == "wrong batch slicing" else mean_step

    def loss_fn(self):
        return None if self.loss == "default" or self.user_step else mean_loss


def draw(r: random.Random, world: int | None = None, check: str | None = None) -> Draw:
    """A random draw; about half carry a bug that fits it."""
    world = world or r.choice((2, 4))
    check = check or r.choice(("grad", "train"))
    dp = r.choice((1, 2)) if world == 4 else r.choice((1, 1, 2))
    plan_kind = r.choice(("megatron", "megatron", "dtensor", "gathered"))
    dropout = r.random() < 0.3
    user_step = check == "train" and r.random() < 0.4
    bugs = [b for b in BUGS if _fits(b, plan_kind, dropout, dp, check, user_step)
            and (world // dp > 1 or b in DP_BUGS)]  # at tp=1 a TP bug is none
    bug = r.choice(bugs) if bugs and r.random() < 0.5 else None
    tp = world // dp
    return Draw(seed=r.randrange(10**6), check=check, world=world, dp=dp,
                d=4 * tp * r.choice((1, 2)), hidden=4 * tp * r.choice((1, 2)),
                blocks=r.choice((1, 2)), dropout=dropout, plan_kind=plan_kind, bug=bug,
                optimizer=r.choice(tuple(OPTIMIZERS)), user_step=user_step,
                loss=r.choice(("default", "mean")), steps=r.choice((1, 2, 3)))


def _fits(bug, plan_kind, dropout, dp, check, user_step) -> bool:
    return {"f omitted": plan_kind == "megatron", "g omitted": plan_kind == "megatron",
            "wrong style": plan_kind == "dtensor",
            "dropout masks differ per rank": dropout,
            "missing dp all-reduce": dp > 1 and check == "grad",
            "wrong batch slicing": user_step}[bug]


# --- the verdicts ------------------------------------------------------------------------

def verdict(lab, dr: Draw) -> bool:
    """tplab's verdict on the draw: ok, or not (a LabError, such as a PlanError, is not ok)."""
    try:
        if dr.check == "grad":
            return tplab.grad_check(lab, dr.build(), dr.plan(), lambda: dr.make_batch()(0),
                                    loss_fn=dr.loss_fn(), dp=dr.dp,
                                    average_dp=dr.bug != "missing dp all-reduce").ok
        return tplab.train_check(lab, dr.build(), dr.plan(), dr.make_batch(), steps=dr.steps,
                                 step=dr.step(), make_optimizer=OPTIMIZERS[dr.optimizer],
                                 loss_fn=dr.loss_fn(), dp=dr.dp, live=False).ok
    except tplab.LabError:
        return False


# --- the truth: plain torch on one device and on the ranks ---------------------------------

def _loss(dr: Draw, out, batch):
    if dr.loss_fn() is not None:
        return mean_loss(out, batch)
    return 0.5 * out.pow(2).sum()


def one_device(dr: Draw, state: dict):
    """Plain torch: the gradients of step 0's batch, or every step's parameters."""
    model = dr.build()()
    model.load_state_dict(state)
    if dr.check == "grad":
        x = dr.make_batch()(0).requires_grad_()
        out = model(x)
        loss = sum(_loss(dr, o, xs) for o, xs in zip(out.chunk(dr.dp), x.chunk(dr.dp),
                                                     strict=True)) / dr.dp
        loss.backward()
        return {"out": out.detach(), "x.grad": x.grad,
                **{n: p.grad for n, p in model.named_parameters()}}
    made = (OPTIMIZERS[dr.optimizer] or _adamw)(model.parameters())
    opt, sched = made if isinstance(made, tuple) else (made, None)
    traj = []
    for i in range(dr.steps):
        batch = dr.make_batch()(i)
        if dr.step() is not None:
            loss = dr.step()(model, opt, batch)
        else:
            out = model(batch)
            loss = sum(_loss(dr, o, b) for o, b in zip(out.chunk(dr.dp), batch.chunk(dr.dp),
                                                       strict=True)) / dr.dp
            loss.backward()
            opt.step()
            opt.zero_grad()
        if sched is not None:
            sched.step()
        traj.append({"loss": loss.detach(),  # (only the ranks' names are compared)
                     **{n: p.detach().clone() for n, p in model.named_parameters()}})
    return traj


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _local(p) -> tuple[torch.Tensor, int | None]:
    """(local piece, shard dim on tp or None) of a parameter or gradient."""
    if isinstance(p, DTensor):
        placement = p.placements[-1]
        return p.to_local().detach(), (placement.dim if placement.is_shard() else None)
    return p.detach(), None


def on_ranks(dr: Draw, state: dict):
    """Rank side of the truth: the same parallel model, plain torch around it."""
    world = dist.get_world_size()
    mesh = tplab.make_mesh(tp=world) if dr.dp == 1 else tplab.make_mesh(dp=dr.dp,
                                                                         tp=world // dr.dp)
    model = dr.build()()
    model.load_state_dict(state)
    if dr.check == "train":
        per_rank_parameters(model)  # tplab.simulate: an optimizer updates each rank's own
    plan = dr.plan()
    model = (dict_plan(plan) if isinstance(plan, dict) else plan)(model, mesh)
    dims = _shard_dims(model)
    if dr.check == "grad":
        x = dr.make_batch()(0)
        if dr.dp > 1:
            x = replica_slice(x, mesh)
        x = x.clone().requires_grad_()
        out = model(x)
        _loss(dr, out, x).backward()
        grads = {n: _local(p.grad)[0] for n, p in model.named_parameters()}
        if dr.dp > 1 and dr.bug != "missing dp all-reduce":
            for g in grads.values():
                dist.all_reduce(g, group=mesh.get_group("dp"))
                g.div_(dr.dp)
        return {"out": out.detach(), "x.grad": x.grad / dr.dp, **grads}, dims
    if dr.dp > 1:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(functools.partial(_ddp, mesh=mesh, dp=dr.dp))
    made = (OPTIMIZERS[dr.optimizer] or _adamw)(model.parameters())
    opt, sched = made if isinstance(made, tuple) else (made, None)
    traj = []
    for i in range(dr.steps):
        batch = dr.make_batch()(i)
        if dr.dp > 1:
            batch = replica_slice(batch, mesh)
        if dr.step() is not None:
            dr.step()(model, opt, batch)
        else:
            _loss(dr, model(batch), batch).backward()
            opt.step()
            opt.zero_grad()
        if sched is not None:
            sched.step()
        traj.append({n: _local(p)[0].clone() for n, p in model.named_parameters()})
    return traj, dims


def _ddp(p, mesh, dp):
    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    dist.all_reduce(g, group=mesh.get_group("dp"))
    g.div_(dp)


def _shard_dims(model) -> dict:
    """{parameter: its shard dim over tp, or None}: the DTensor's placement, or the
    hand-written layer's `tp_placements`."""
    dims = {}
    for mname, m in model.named_modules():
        declared = getattr(m, "tp_placements", {})
        for pname, p in m.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(p, DTensor):
                dims[name] = _local(p)[1]
            else:
                placement = declared.get(pname)
                dims[name] = placement.dim if placement is not None and \
                    placement.is_shard() else None
    return dims


def _expected(full: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    return full if dim is None else full.chunk(tp, dim)[rank % tp]


def truth(lab, dr: Draw) -> str:
    """"ok", "bad" or "unclear": every rank's local pieces against one device's, cut the
    same way (outputs and input gradients of a dp replica: its slice of the batch)."""
    model = dr.build()()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want = one_device(dr, state)
    values = want.values() if isinstance(want, dict) else [t for w in want for t in w.values()]
    if any(t is not None and not torch.isfinite(t).all() for t in values):
        return "unclear"  # the training itself overflows: nothing to judge
    try:
        got = lab.run(on_ranks, dr, state)
    except tplab.LabError as e:
        if DEBUG:
            print("truth run failed:", str(e)[-400:])
        return "bad"  # the run itself fails: not what one device computes
    worst = 0.0
    for rank, (values, dims) in enumerate(got):
        replica = rank // dr.tp
        if dr.check == "grad":
            for name, g in values.items():
                full = want[name]
                if name in ("out", "x.grad"):
                    full = full.chunk(dr.dp)[replica]
                if g is None or full is None:
                    return "bad" if (g is None) != (full is None) else "ok"
                exp = _expected(full, dims.get(name), dr.tp, rank)
                if exp.shape != g.shape:
                    return "bad"
                scale = float(want[name].abs().max()) + 1e-6
                worst = max(worst, float((g - exp).abs().max()) / scale)
            continue
        for i, params in enumerate(values):
            for name, p in params.items():
                exp = _expected(want[i][name], dims.get(name), dr.tp, rank)
                start = _expected(state[name], dims.get(name), dr.tp, rank)
                if exp.shape != p.shape:
                    return "bad"
                moved = float((exp - start).pow(2).mean().sqrt()) + 1e-12
                worst = max(worst, float((p - exp).pow(2).mean().sqrt()) / moved)
    if DEBUG:
        print("truth worst", worst)
    if dr.check == "grad":
        return "ok" if worst < 1e-4 else "bad" if worst > 1e-2 else "unclear"
    return "ok" if worst < 5e-3 else "bad" if worst > 5e-2 else "unclear"


def judge(lab, dr: Draw) -> tuple[str, bool]:
    """(truth, tplab's verdict) of one draw."""
    return truth(lab, dr), verdict(lab, dr)
