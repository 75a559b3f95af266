"""tplab.rng: dropout outside the TP regions with a per-rank seed makes the replicas diverge
(grad_check's replica_spread rows catch it); Megatron's tracker (the same seed outside the
regions, a per-rank one inside) fixes it."""

from __future__ import annotations

import functools

import pytest
import torch

import tplab
from tplab import models, plans, rng

CFG = models.Config(dim=16, n_heads=4, hidden_dim=32, seq_len=4, batch_size=2)


def _check(lab, region):
    build = functools.partial(models.DropoutBlock, CFG, 0.2, region, 7)
    plan = functools.partial(rng.parallelize, plan=plans.block(), seed=7)
    return tplab.grad_check(lab, build, plan, functools.partial(models.make_input, CFG))


@pytest.fixture(scope="module")
def sim():
    return tplab.simulate(2)


def test_a_per_rank_seed_outside_the_tp_regions_makes_the_replicas_diverge(sim):
    report = _check(sim, "tp")
    assert not report.ok
    spread = {r["name"]: r for r in report.rows if r["kind"] == "replica_spread"}
    assert not spread["output"]["ok"] and spread["output"]["max_abs"] > 0.01
    # the weight gradients of the replicated norms differ between the copies too
    assert not spread["ffn_norm.weight"]["ok"]


def test_the_tracker_keeps_replicated_dropout_identical_on_every_rank(sim):
    report = _check(sim, "replicated")
    assert report.ok, str(report)
    assert all(r["max_abs"] == 0 for r in report.rows if r["kind"] == "replica_spread")


def _masks(seed):
    mesh = tplab.make_mesh()
    tracker = rng.RNGTracker(mesh, seed)
    return {"replicated": tracker.rand((64,)), "tp": tracker.rand((64,), "tp")}


def test_tp_regions_draw_a_different_mask_on_each_rank(sim):
    masks = sim.run(_masks, 3)
    assert torch.equal(masks[0]["replicated"], masks[1]["replicated"])
    assert not torch.equal(masks[0]["tp"], masks[1]["tp"])
    one = rng.RNGTracker(None, 3)            # rank 0's stream is seed + 2718
    assert torch.equal(masks[0]["tp"], torch.rand(64, generator=torch.Generator().manual_seed(
        3 + 2718)))
    assert torch.equal(masks[0]["replicated"], one.rand((64,)))
    with pytest.raises(ValueError, match="region"):
        rng.Dropout(0.1, "inside")


@pytest.mark.parametrize("path", ["dtensor", "megatron"])
def test_replicated_dropout_under_sequence_parallelism_matches_one_device(sim, path):
    # each rank keeps its sequence shard of the one-device mask (not a whole mask of its own)
    from tplab import megatron

    sp = (plans.block(sequence_parallel=True) if path == "dtensor"
          else functools.partial(megatron.parallelize, sequence_parallel=True))
    build = functools.partial(models.DropoutBlock, CFG, 0.1, "replicated", 0)
    plan = functools.partial(rng.parallelize, plan=sp, seed=0)
    report = tplab.grad_check(sim, build, plan, functools.partial(models.make_input, CFG))
    assert report.ok, str(report)
    # without the tracker knowing the stream is sequence-sharded, the masks repeat per shard
    wrong = functools.partial(rng.parallelize, plan=sp, seed=0, sequence_parallel=False)
    assert not tplab.grad_check(sim, build, wrong,
                                functools.partial(models.make_input, CFG)).ok


def test_one_device_draws_tp_masks_as_the_ranks_do(sim):
    def masks():
        return rng.RNGTracker(tplab.make_mesh(), 5).rand((3, 4), "tp")

    ranks = sim.run(masks)
    one = rng.RNGTracker(None, 5, tp=2).rand((3, 8), "tp", dim=-1)
    assert torch.equal(torch.cat(ranks, -1), one)
    with pytest.raises(ValueError, match="tp=2"):
        rng.RNGTracker(None, 5, tp=2).rand((3, 7), "tp")
    with pytest.raises(ValueError, match="sequence_parallel"):
        rng.RNGTracker(None, 5, sequence_parallel=True)
