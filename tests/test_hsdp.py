"""HSDP x TP (replicate x shard x tp), torchtitan's 3-D recipe, at world 8 on CPU with gloo:
2 replicas x 2 shards x 2 tp ranks. The truth is one device: grad_check assembles each
gradient from its placements on all three mesh dims and compares it with the gradient of
the mean of the 4 dp slices' losses on one device; train_check trains both. Summing the
replicas' gradients instead of averaging them (the planted bug) is caught, on dp.

Eight rank processes on a small machine: `extended` (make test-extended).
"""

from __future__ import annotations

import functools

import pytest

import tplab
from tplab import fsdp, fsdp_report, models, plans

CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=4,
                    batch_size=8)
MLP = functools.partial(models.MLP, CFG)
INPUT = functools.partial(models.make_input, CFG)
HSDP_TP = fsdp.hsdp(replicate=2, tp_plan=plans.mlp())


def mean(out, x):
    return out.pow(2).mean()


def seeded(i):
    return models.make_input(CFG, seed=i)


@pytest.mark.slow
@pytest.mark.extended
def test_hsdp_x_tp_at_world_8_passes_and_a_summed_reduction_is_caught_on_dp():
    with tplab.launch(8, timeout=120) as lab:
        placed = lab.run(fsdp.placements_after, MLP, HSDP_TP, 4)[0]
        assert placed["w1.weight"] == {"dp_replicate": "Replicate()",
                                       "dp_shard": "_StridedShard(dim=0, split_factor=2)",
                                       "tp": "Shard(0)"}, placed
        assert placed["w2.weight"] == {"dp_replicate": "Replicate()", "dp_shard": "Shard(0)",
                                       "tp": "Shard(1)"}, placed
        report = tplab.grad_check(lab, MLP, HSDP_TP, INPUT, mean, dp=4)
        assert report.ok, str(report)
        run = tplab.train_check(lab, MLP, HSDP_TP, seeded, steps=3, dp=4, loss_fn=mean,
                                live=False)
        assert run.ok, str(run)
        summed = tplab.grad_check(lab, MLP, fsdp.hsdp(2, plans.mlp(), reduce="sum"), INPUT,
                                  mean, dp=4)
        assert not summed.ok, str(summed)
        assert set(fsdp_report.dims_of(summed).values()) == {"dp"}, str(summed)
