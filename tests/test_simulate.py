"""tplab.simulate: the .run contract of tplab.launch in one process, and its documented traps
(rank-dependent control flow, per-rank randomness, AsyncCollectiveTensor outputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from tp_fixtures import CFG

import tplab
from tplab import LabError, RankError
from tplab.core.transfer import LocalShard
from tplab.mesh import make_mesh


def _dtensors():
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tplab.mesh import make_mesh

    mesh = make_mesh(dp=2, tp=2)
    full = torch.arange(16.0).reshape(4, 4)
    return {"rows": distribute_tensor(full, mesh, [Replicate(), Shard(0)]),
            "blocks": distribute_tensor(full, mesh, [Shard(1), Shard(0)]),
            "coord": mesh.get_coordinate(), "rank": dist.get_rank()}


def test_run_returns_one_result_per_rank_with_dtensors_as_local_shards():
    sim = tplab.simulate(4)
    assert (sim.world_size, sim.backend, sim.pids) == (4, "simulated", [])
    full = torch.arange(16.0).reshape(4, 4)
    for r, out in enumerate(sim.run(_dtensors)):
        d, t = divmod(r, 2)
        assert out["rank"] == r and out["coord"] == [d, t]
        rows, blocks = out["rows"], out["blocks"]
        assert isinstance(rows, LocalShard) and rows.placements == ("Replicate()", "Shard(0)")
        assert rows.coordinate == (d, t) and rows.offsets == (2 * t, 0) and rows.rank == r
        assert torch.equal(rows.local, full[2 * t:2 * t + 2])
        assert blocks.offsets == (2 * t, 2 * d) and blocks.mesh_dim_names == ("dp", "tp")
        assert torch.equal(blocks.local, full[2 * t:2 * t + 2, 2 * d:2 * d + 2])
        assert rows.global_shape == (4, 4) and rows.mesh_shape == (2, 2)


def _rowwise_output(cfg):
    import tplab
    from tplab import models, plans
    from tplab.mesh import make_mesh

    model = tplab.apply_plan(models.MLP(cfg), make_mesh(), plans.mlp())
    out = model(models.make_input(cfg))
    return type(out).__name__, out


def test_async_collective_outputs_come_back_as_plain_tensors():
    sim = tplab.simulate(2)
    results = sim.run(_rowwise_output, CFG)
    assert results[0][0] == "AsyncCollectiveTensor"  # the trap: RowwiseParallel's output
    ref = tplab.models.MLP(CFG)(tplab.models.make_input(CFG))
    for _, out in results:
        assert type(out) is torch.Tensor and torch.allclose(out, ref, atol=1e-6)


def test_an_exception_becomes_a_rank_error_from_every_rank():
    sim = tplab.simulate(2)
    with pytest.raises(RankError, match="ZeroDivisionError") as err:
        sim.run(lambda: 1 / 0)
    assert err.value.ranks == [0, 1] and err.value.enames == {0: "ZeroDivisionError",
                                                              1: "ZeroDivisionError"}


def _branch():
    import torch.distributed as dist

    return "rank 0" if dist.get_rank() == 0 else "not rank 0"


def test_rank_dependent_control_flow_is_a_documented_limit():
    sim = tplab.simulate(2)
    # fn runs once for all ranks: the comparison holds for no single rank, so every rank
    # takes the same branch (in processes rank 0 would say "rank 0")
    assert sim.run(_branch) == ["not rank 0", "not rank 0"]
    with pytest.raises(RankError, match="LocalIntNode"):
        sim.run(lambda: int(dist.get_rank()))
    # rank-dependent values in tensor ops work
    assert [t.tolist() for t in sim.run(lambda: torch.ones(2) * dist.get_rank())] == [
        [0.0, 0.0], [1.0, 1.0]]


@dataclasses.dataclass(frozen=True)
class _Record:
    shard: object
    value: object
    n: int = 1


def _records():
    d = distribute_tensor(torch.arange(8.0).reshape(4, 2), make_mesh(), [Shard(0)])
    return _Record(d, torch.ones(2) * dist.get_rank(), 3)


def test_dataclass_results_come_back_per_rank_as_from_rank_processes():
    # what rank processes send (tests/test_misuse.py): tplab's records (StepResult,
    # ParamLayout) are dataclasses, their tensors each rank's own
    results = tplab.simulate(2).run(_records)
    assert [type(r) for r in results] == [_Record, _Record] and results[1].n == 3
    assert [r.value.tolist() for r in results] == [[0.0, 0.0], [1.0, 1.0]]
    for rank, r in enumerate(results):
        assert isinstance(r.shard, tplab.LocalShard) and r.shard.placements == ("Shard(0)",)
        assert r.shard.offsets == (2 * rank, 0) and r.shard.global_shape == (4, 2)
        assert torch.equal(r.shard.local, torch.arange(8.0).reshape(4, 2)[2 * rank:2 * rank + 2])


def _randomness(cfg):
    import torch

    from tplab import models

    g = torch.Generator().manual_seed(0)
    return torch.randn(3, generator=g), torch.randn(3), models.make_input(cfg)


def test_random_ops_on_a_generator_differ_per_rank_but_lab_inputs_do_not():
    sim = tplab.simulate(2)
    (g0, d0, x0), (g1, d1, x1) = sim.run(_randomness, CFG)
    assert not torch.equal(g0, g1)  # the trap
    assert torch.equal(d0, d1) and torch.equal(x0, x1)
    assert torch.equal(x0, tplab.models.make_input(CFG))  # the notebook's own value


def test_switching_world_sizes_and_the_lab_lifecycle_no_ops():
    with tplab.simulate(2) as two:
        assert two.run(dist.get_world_size) == [2, 2]
        four = tplab.simulate(4)
        assert four.run(dist.get_world_size) == [4] * 4
        assert two.run(dist.get_rank) == [0, 1]  # re-creates its own world
        assert len(two.run(_dtensors_2d_needs_4)) == 2
    two.shutdown()
    two.restart()


def _dtensors_2d_needs_4():
    from tplab.mesh import make_mesh

    return tuple(make_mesh().shape)


def test_execute_push_and_pull_share_a_namespace_like_rank_processes():
    sim = tplab.simulate(2)
    sim.push({"k": 3})
    assert sim.execute("v = torch.ones(1) * (rank + k)\nworld_size") == [2, 2]
    assert [t.item() for t in sim.pull("v")] == [3.0, 4.0]
    assert [t.item() for t in sim.execute("v + dist.get_rank()")] == [3.0, 5.0]
    with pytest.raises(RankError, match="must be equal for all ranks"):
        sim.execute("v.item()")  # a Python number cannot differ per rank: a documented limit
    assert sim.execute("rank * 10", ranks=[1]) == [10]
    with pytest.raises(LabError, match="'nope' is not defined"):
        sim.pull("nope")


def test_a_process_with_a_real_group_cannot_simulate(monkeypatch):
    sim = tplab.simulate(2)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    with pytest.raises(LabError, match="already has a real process group"):
        sim.run(dist.get_world_size)
