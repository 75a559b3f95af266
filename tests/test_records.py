"""The typed records that travel from the ranks to the notebook (issue 29): `ParamLayout`
(tplab.layouts), `Pair` (tplab.core.pairing), `StepResult` (tplab.rank.grad_step). They are frozen
(a pair that learns more is a new one) and survive pickle, as rank processes send them."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import tplab
from tplab.checks.grad_params import param_rows
from tplab.core.pairing import Pair, pair
from tplab.layouts import ParamLayout, tp_layout
from tplab.mesh import make_mesh
from tplab.plans import apply_plan, mlp
from tplab.rank.grad_step import StepResult


def test_pair_gives_frozen_pairs_by_name_param_map_and_order():
    ref = {"fc.weight": (9, 4), "out.weight": (4, 8), "free": (3,)}
    ranks = {"fc.weight": ParamLayout(None, None, (5, 4)),  # a dim padded to 10 over tp=2
             "w_out": ParamLayout(None, "Shard(1)", (4, 4)),
             "extra": ParamLayout(None, None, (7,))}
    pairs, lone_ranks, lone_ref, problems = pair(ref, ranks, 2, {"w_out": "out.weight"})
    assert pairs == [Pair("w_out", "out.weight", "Shard(1)", 0, "param_map"),
                     Pair("fc.weight", "fc.weight", "Shard(0)", 10, "name")]
    assert (lone_ranks, lone_ref, problems) == (["extra"], ["free"], {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        pairs[0].padded = 3
    assert pickle.loads(pickle.dumps(pairs)) == pairs


def _step_records():
    model = apply_plan(tplab.models.MLP(tplab.models.Config(dim=8, hidden_dim=16)),
                       make_mesh(), mlp())
    model(torch.ones(2, 3, 8)).sum().backward()
    return tp_layout(model)


def test_tp_layout_gives_param_layouts_that_survive_pickle():
    layouts = tplab.simulate(2).run(_step_records)
    for rank, got in enumerate(layouts):
        assert all(isinstance(info, ParamLayout) for info in got.values())
        w1 = got["w1.weight"]
        assert (w1.placement, w1.shape, w1.global_shape) == ("Shard(0)", (8, 8), (16, 8))
        assert w1.value.shape == (8, 8) and w1.index.shape == (8, 8)
        assert torch.equal(w1.index.reshape(-1)[:2], torch.tensor([64 * rank, 64 * rank + 1]))
        back = pickle.loads(pickle.dumps(w1))
        assert torch.equal(back.value, w1.value) and back.placement == w1.placement
    with pytest.raises(dataclasses.FrozenInstanceError):
        w1.value = None


def test_a_step_result_is_frozen():
    result = StepResult({}, torch.zeros(()), {}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.loss = torch.ones(())


def _whole_mesh_layout(weight, grad):
    """A rank's tp_layout of a weight and its gradient on the whole (dp, tp) mesh, held as
    FSDP2 x TP holds them: Replicate() over dp, Shard(0) over tp."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = make_mesh(dp=2, tp=2)
    model = torch.nn.Linear(4, 6, bias=False)
    model.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Replicate(), Shard(0)]))
    model.weight.grad = distribute_tensor(grad, mesh, [Replicate(), Shard(0)])
    return tp_layout(model)


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["right", "twice the gradient"])
def test_a_dtensor_on_the_whole_mesh_is_paired_by_its_tp_placement_and_placed_whole(scale):
    # no "mesh" pseudo-placement: the layout says whole_mesh and its placement on tp; the
    # report's pair column shows its placement on each mesh dim; the verdict is judged
    # against the whole gradient set by hand
    ref = torch.nn.Linear(4, 6, bias=False)
    ref.weight.grad = torch.randn(6, 4)
    layouts = tplab.simulate(4).run(_whole_mesh_layout, ref.weight.detach().clone(),
                                    ref.weight.grad * scale)
    info = layouts[0]["weight"]
    assert (info.whole_mesh, info.placement, info.index) == (True, "Shard(0)", None)
    assert pair({"weight": (6, 4)}, layouts[0], 2)[0] == [
        Pair("weight", "weight", "Shard(0)", 0, "name", whole_mesh=True)]
    rows: list = []
    param_rows(ref, [StepResult({}, torch.zeros(()), {}, got) for got in layouts], 2, None,
               rows, 1e-6, 1e-6)
    (row,) = [r for r in rows if r["kind"] == "param_grad"]
    assert row["pair"] == "dp: Replicate(), tp: Shard(0)"
    assert row["ok"] == (scale == 1.0)
    assert row["note"] == ("" if scale == 1.0 else "= 2 x the reference (a collective summed "
                                                   "2 copies?)")
