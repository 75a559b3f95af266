"""tplab.grad_check: the parallel models match the single-device reference, on simulated
ranks and on processes; a missing backward all-reduce in f is caught, as an input-gradient
error; and the assembly of shards on the notebook side."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tp_fixtures import CFG, activations, build, tokens, tp_lab  # noqa: F401

import tplab
from tplab import megatron, models, plans
from tplab.checks.grad import GradCheckReport, assemble
from tplab.core.transfer import LocalShard

SP = functools.partial(megatron.parallelize, sequence_parallel=True)

CASES = {
    "mlp-dtensor": (models.MLP, plans.mlp(), False),
    "mlp-megatron": (models.MLP, megatron.parallelize, False),
    "mlp-megatron-sp": (models.MLP, SP, False),  # w2's bias grad: partial on sequence shards
    "block-dtensor": (models.Block, plans.block(), False),
    "block-dtensor-sp": (models.Block, plans.block(sequence_parallel=True), False),
    "block-megatron": (models.Block, megatron.parallelize, False),
    "block-megatron-sp": (models.Block, SP, False),
    "lm-dtensor": (models.TinyLM, plans.lm(), True),
    "lm-dtensor-sp": (models.TinyLM, plans.lm(sequence_parallel=True), True),
    "lm-megatron": (models.TinyLM, megatron.parallelize, True),
    "lm-megatron-sp": (models.TinyLM, SP, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_models_match_the_reference(tp_lab, case):  # noqa: F811
    cls, plan, lm = CASES[case]
    make_input, loss = (tokens(), models.lm_loss) if lm else (activations(), None)
    report = tplab.grad_check(tp_lab, build(cls), plan, make_input, loss)
    assert report.ok, str(report)
    names = {r["name"] for r in report.rows if r["kind"] == "param_grad"}
    assert names == {n for n, _ in cls(CFG).named_parameters()}  # every parameter checked
    kinds = {r["kind"] for r in report.rows}
    assert kinds >= {"output", "param_grad", "replica_spread"}
    assert ("input_grad" in kinds) is (not lm)  # token ids have no gradient
    assert report.world_size == tp_lab.world_size
    if case == "block-dtensor-sp":  # norms on sequence shards: their weight grads stay Partial
        notes = {r["name"]: r["note"] for r in report.rows if r["kind"] == "param_grad"}
        assert "Partial" in notes["attention_norm.weight"] and not notes["attention.wq.weight"]


def test_losing_f_backward_all_reduce_makes_only_the_input_gradient_wrong(tp_lab):  # noqa: F811
    broken = functools.partial(megatron.parallelize, reduce_grad=False)
    report = tplab.grad_check(tp_lab, build(models.MLP), broken, activations())
    assert not report.ok
    assert {(r["name"], r["kind"]) for r in report.failures} == {
        ("input", "input_grad"), ("input", "replica_spread")}
    assert "input gradient wrong" in report.summary()
    assert report.max_abs > 1e-2  # not a rounding error
    for text in (str(report), report._repr_html_()):
        assert "WRONG" in text and "w1.weight" in text


def test_a_plan_that_forgets_g_gives_a_wrong_output():
    # w2's partial sums handed on as they are: the DTensor form of a missing g
    sim = tplab.simulate(2)
    wrong = {"w1": ColwiseParallel(), "w2": RowwiseParallel(output_layouts=Partial())}
    report = tplab.grad_check(sim, build(models.MLP), wrong, activations())
    failed = {(r["name"], r["kind"]) for r in report.failures}
    assert ("output", "output") in failed and ("output", "replica_spread") in failed


def test_loss_fn_may_take_the_output_alone_or_with_the_input():
    sim = tplab.simulate(2)
    one = tplab.grad_check(sim, build(models.MLP), plans.mlp(), activations(),
                           lambda out: out.sum())
    two = tplab.grad_check(sim, build(models.MLP), plans.mlp(), activations(),
                           lambda out, x: (out * x).sum())
    assert one.ok and two.ok and one.loss != two.loss


def shard(local, placements, coord, offsets, global_shape, mesh_shape=(2, 2), rank=0):
    return LocalShard(local=local, placements=placements, global_shape=global_shape,
                      mesh_shape=mesh_shape, mesh_dim_names=("dp", "tp"), coordinate=coord,
                      rank=rank, offsets=offsets)


def test_assemble_places_shards_sums_partials_and_measures_replica_spread():
    full = torch.arange(8.0).reshape(2, 4)
    # mesh (dp=2, tp=2), placements (Replicate, Shard(1)): dp replicas of column halves
    shards = [shard(full[:, 2 * c:2 * c + 2].clone(), ("Replicate()", "Shard(1)"), (d, c),
                    (0, 2 * c), (2, 4)) for d in range(2) for c in range(2)]
    shards[3].local[0, 0] += 0.5  # rank (1, 1) drifted from its replica
    got, spread = assemble(shards)
    assert torch.equal(got, full) and spread == 0.5
    # Partial(sum) over tp: the two halves of a sum
    parts = [shard(full * (c + 1) / 3, ("Replicate()", "Partial(sum)"), (d, c), (0, 0), (2, 4))
             for d in range(2) for c in range(2)]
    got, spread = assemble(parts)
    assert torch.allclose(got, full) and spread == 0.0
    # plain tensors: the first rank's value and the largest difference from it
    got, spread = assemble([full, full + 1e-3, full])
    assert torch.equal(got, full) and spread == pytest.approx(1e-3, rel=1e-3)
    assert assemble([full, None]) == (None, None)


def test_report_rows_follow_the_contract():
    rows = [{"name": "output", "kind": "output", "max_abs": 0.0, "max_rel": 0.0, "ok": True,
             "note": ""},
            {"name": "w1.weight", "kind": "param_grad", "max_abs": 1.0, "max_rel": 0.5,
             "ok": False, "note": ""}]
    report = GradCheckReport(rows, world_size=2, atol=1e-5, rtol=1e-4)
    assert not report.ok and report.max_abs == 1.0 and report.failures == rows[1:]
    assert "gradient of w1.weight wrong" in report.summary()
    assert "<table" in report._repr_html_()


# --- 2-D: data parallel over dp, tensor parallel within each tp group ---------------------

BATCH4 = dataclasses.replace(CFG, batch_size=4)  # two sequences for each of 2 dp replicas
CASES_2D = ["mlp-dtensor", "mlp-megatron", "mlp-megatron-sp", "block-dtensor-sp",
            "block-megatron", "lm-dtensor", "lm-megatron-sp"]


@pytest.mark.parametrize("case", CASES_2D)
def test_a_2d_check_splits_the_batch_over_dp_and_averages_the_gradients(tp_lab, case):  # noqa: F811
    if tp_lab.world_size != 4:
        pytest.skip("a (dp=2, tp=2) mesh needs 4 ranks")
    cls, plan, lm = CASES[case]
    make_input, loss = ((tokens(BATCH4), models.lm_loss) if lm else (activations(BATCH4), None))
    report = tplab.grad_check(tp_lab, build(cls), plan, make_input, loss, dp=2, tp=2)
    assert report.ok, str(report)
    names = {r["name"] for r in report.rows if r["kind"] == "param_grad"}
    assert names == {n for n, _ in cls(CFG).named_parameters()}
    spread = {r["name"] for r in report.rows if r["kind"] == "replica_spread"}
    assert names <= spread  # dp replicas (and tp copies) of every gradient compared
    assert report.mesh_shape == {"dp": 2, "tp": 2} and "(dp=2 x tp=2)" in report.summary()
    # the reference loss is the mean of the replicas' losses, each on its half of the batch
    x, model = make_input(), cls(CFG)
    per_replica = [(loss or (lambda out: 0.5 * out.pow(2).sum()))(model(half), *[half] * lm)
                   for half in x.chunk(2)]
    assert report.loss == pytest.approx(float(sum(per_replica).detach() / 2), rel=1e-6)


def _mlp_with_own_dp_average(model, mesh):
    """A plan that does data parallelism itself: hooks average every gradient over dp."""
    import torch.distributed as dist

    from tplab import plans

    model = tplab.apply_plan(model, mesh, plans.mlp())

    def average(param):
        grad = param.grad.to_local()
        dist.all_reduce(grad, group=mesh.get_group("dp"))
        grad /= mesh["dp"].size()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    return model


def test_a_2d_check_catches_a_missing_dp_average_and_accepts_the_plans_own():
    sim = tplab.simulate(4)
    tp_only = functools.partial(tplab.apply_plan, plan=plans.mlp())
    # no average over dp at all: each replica keeps the gradient of its own half
    report = tplab.grad_check(sim, build(models.MLP), tp_only, activations(BATCH4), tp=2,
                              average_dp=False)
    failed = {(r["name"], r["kind"]) for r in report.failures}
    assert ("w1.weight", "param_grad") in failed and ("w1.weight", "replica_spread") in failed
    assert not {kind for _, kind in failed} & {"output", "input_grad"}
    # the plan's own average (notebook 06's hooks), so grad_check must not add its own
    own = tplab.grad_check(sim, build(models.MLP), _mlp_with_own_dp_average,
                           activations(BATCH4), dp=2, average_dp=False)
    assert own.ok, str(own)


def test_a_2d_check_says_when_the_mesh_or_the_batch_does_not_fit():
    sim = tplab.simulate(4)
    with pytest.raises(tplab.LabError, match="tp=3 must be a positive int that divides"):
        tplab.grad_check(sim, build(models.MLP), plans.mlp(), activations(), tp=3)
    with pytest.raises(tplab.LabError, match=r"dp=2 x tp=4 = 8 ranks, but the lab has 4"):
        tplab.grad_check(sim, build(models.MLP), plans.mlp(), activations(), dp=2, tp=4)
    odd = dataclasses.replace(CFG, batch_size=3)
    with pytest.raises(tplab.LabError, match=r"dim 0 of the input \(shape \(3, 4, 16\)\) must "
                                             r"divide into dp=2"):
        tplab.grad_check(sim, build(models.MLP), plans.mlp(), activations(odd), dp=2)


def test_a_bad_plan_is_refused_in_the_notebook_before_the_ranks_run_anything():
    import pytest
    from torch.distributed.tensor.parallel import ColwiseParallel

    import tplab
    from tplab import models

    sim = tplab.simulate(2)
    cfg = models.Config(dim=16, hidden_dim=32, n_heads=2, seq_len=4, batch_size=2)
    with pytest.raises(tplab.PlanError, match="closest module paths"):
        tplab.grad_check(sim, lambda: models.MLP(cfg), {"w11": ColwiseParallel()},
                         lambda: models.make_input(cfg))
