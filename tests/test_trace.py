"""tplab.trace: counts per phase, the record format of docs/CONTRACTS.md, agreement with
torch's CommDebugMode, and plain torch.distributed calls (hand-written f and g)."""

from __future__ import annotations

import pytest
from tp_fixtures import CFG, MODES, lab_of

# tp_fixtures' modes, but 2 simulated ranks repeat 4 simulated ranks at another size: the
# extended suite; 4 simulated ranks and 2 and 4 rank processes run by default
TRACE_MODES = [pytest.param(*m.values, id=m.id, marks=[*m.marks, pytest.mark.extended])
               if m.id == "sim2" else m for m in MODES]


@pytest.fixture(scope="module", params=TRACE_MODES)
def tp_lab(request):
    return lab_of(request)

KEYS = {"rank", "seq", "phase", "module", "op", "shape", "dtype", "bytes", "group",
        "group_size", "duration_ms", "start_ms", "cause"}


def _mlp_step(cfg, path, input_grad):
    """Rank side: one traced forward and backward of the MLP; its records and counts."""
    import tplab
    from tplab import megatron, models, plans
    from tplab.mesh import make_mesh

    mesh = make_mesh()
    model = models.MLP(cfg)
    model = (megatron.parallelize(model, mesh) if path == "megatron"
             else tplab.apply_plan(model, mesh, plans.mlp()))
    x = models.make_input(cfg).requires_grad_(input_grad)
    with tplab.trace() as t:
        model(x).pow(2).sum().backward()
    return {"records": t.records, "counts": t.counts()}


@pytest.mark.parametrize("path", ["dtensor", "megatron"])
def test_mlp_counts_one_all_reduce_each_way_and_none_back_without_input_grad(tp_lab, path):
    with_grad = tp_lab.run(_mlp_step, CFG, path, True)
    assert all(r["counts"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
               for r in with_grad)
    # f's backward all-reduce only exists to make the input's gradient
    without = tp_lab.run(_mlp_step, CFG, path, False)
    assert all(r["counts"] == {"forward": {"all_reduce": 1}, "backward": {}} for r in without)


def test_records_follow_the_contract(tp_lab):
    n = tp_lab.world_size
    for rank, result in enumerate(tp_lab.run(_mlp_step, CFG, "dtensor", True)):
        fwd, bwd = result["records"]
        for i, rec in enumerate((fwd, bwd)):
            assert set(rec) == KEYS
            assert rec["rank"] == rank and rec["seq"] == i
            assert rec["op"] == "all_reduce" and rec["dtype"] == "float32"
            assert rec["shape"] == [CFG.batch_size, CFG.seq_len, CFG.dim]
            assert rec["bytes"] == 4 * CFG.batch_size * CFG.seq_len * CFG.dim
            assert rec["group"] == "tp" and rec["group_size"] == n
            assert isinstance(rec["duration_ms"], float) and rec["duration_ms"] >= 0
        # issued in order, the backward one after the forward one has finished
        assert 0 <= fwd["start_ms"] <= fwd["start_ms"] + fwd["duration_ms"] <= bwd["start_ms"]
        # g sits after w2 (its output redistribution); f's backward at w1's input
        assert (fwd["phase"], fwd["module"]) == ("forward", "w2")
        assert (bwd["phase"], bwd["module"]) == ("backward", "w1")
        # why: g is RowwiseParallel's output Partial -> Replicate; f is the backward of
        # ColwiseParallel's replicated input, whose gradient arrives Partial
        assert fwd["cause"] == "Partial(sum) -> Replicate() (RowwiseParallel output)"
        assert bwd["cause"] == "Partial(sum) -> Replicate()"


def _block_step(cfg, sequence_parallel):
    """The same traced step seen by tplab.trace and by torch's CommDebugMode at once."""
    from torch.distributed.tensor.debug import CommDebugMode

    import tplab
    from tplab import models, plans
    from tplab.mesh import make_mesh

    plan = plans.block(sequence_parallel)
    model = tplab.apply_plan(models.Block(cfg), make_mesh(), plan)
    x = models.make_input(cfg).requires_grad_()
    with tplab.trace() as t, CommDebugMode() as cm:
        model(x).pow(2).sum().backward()
    names = {"c10d_functional.all_reduce": "all_reduce",
             "c10d_functional.all_gather_into_tensor": "all_gather",
             "c10d_functional.reduce_scatter_tensor": "reduce_scatter",
             "c10d_functional.all_to_all_single": "all_to_all"}
    torch_counts = {phase: {names[str(op)]: n for op, n in
                            cm.comm_module_counts["Global"][phase].items()}
                    for phase in ("forward", "backward")}
    colwise = sum(type(s).__name__ == "ColwiseParallel" for s in plan.values())
    return {"counts": t.counts(), "torch": torch_counts, "colwise": colwise,
            "total": cm.get_total_counts()}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_block_counts_match_comm_debug_mode(tp_lab, sequence_parallel):
    for r in tp_lab.run(_block_step, CFG, sequence_parallel):
        assert r["counts"] == r["torch"]
        assert sum(sum(p.values()) for p in r["counts"].values()) == r["total"] > 0
        ops = {op for phase in r["counts"].values() for op in phase}
        if sequence_parallel:
            assert ops == {"all_gather", "reduce_scatter"}
        else:
            # one backward all-reduce per column-parallel linear (q, k, v, w1, w3)
            assert ops == {"all_reduce"}
            assert r["counts"]["backward"]["all_reduce"] == r["colwise"]


def _megatron_block_step(cfg):
    import tplab
    from tplab import megatron, models
    from tplab.mesh import make_mesh

    model = megatron.parallelize(models.Block(cfg), make_mesh())
    x = models.make_input(cfg).requires_grad_()
    with tplab.trace() as t:
        model(x).pow(2).sum().backward()
    return t.counts()


def test_megatron_block_has_one_f_per_region(tp_lab):
    # attention and feed-forward: one g forward and one f backward each, where DTensor's
    # ColwiseParallel on q, k, v (and w1, w3) pays one backward all-reduce per linear
    for counts in tp_lab.run(_megatron_block_step, CFG):
        assert counts == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}


def _plain_calls():
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    import tplab
    from tplab.mesh import make_mesh

    n = dist.get_world_size()
    mesh = make_mesh()
    group = mesh.get_group()
    x = torch.ones(n, 3)
    with tplab.trace() as t:
        dist.all_reduce(x, group=group)
        dist.all_gather_single(torch.empty(n * n, 3), x, group=group)
        dist.reduce_scatter_single(torch.empty(1, 3), x, group=group)
        dist.broadcast(x, src=0, group=group)
        dt = distribute_tensor(torch.zeros(n, 2 * n), mesh, [Shard(0)])
        dt.redistribute(mesh, [Shard(1)]).to_local()
    return t.records


def test_plain_torch_distributed_calls_are_traced_with_message_bytes(tp_lab):
    n = tp_lab.world_size
    # Shard(0) -> Shard(1): an all-to-all of this rank's (1, 2n) block; on CPU processes
    # DTensor falls back to all-gathering the whole (n, 2n) (gloo has no all-to-all)
    reshard = (("all_to_all", 4 * 2 * n) if tp_lab.backend == "simulated"
               else ("all_gather", 4 * 2 * n * n))
    for records in tp_lab.run(_plain_calls):
        got = [(r["op"], r["bytes"], r["group"], r["module"], r["phase"]) for r in records]
        assert got == [(op, nbytes, "tp", "", "forward") for op, nbytes in [
            ("all_reduce", 4 * n * 3), ("all_gather", 4 * n * n * 3),
            ("reduce_scatter", 4 * n * 3), ("broadcast", 4 * n * 3),
            ("scatter", 4 * n * 2 * n),  # distribute_tensor: rank 0 scatters the rows
            reshard]]


def _two_d_mesh_and_reentry():
    import torch
    import torch.distributed as dist

    import tplab
    from tplab.mesh import make_mesh

    mesh = make_mesh(dp=2, tp=2)
    x = torch.ones(2) * (dist.get_rank() + 1)
    t = tplab.trace()
    with t:
        dist.all_reduce(x, group=mesh.get_group("tp"))
    first = [(r["group"], r["group_size"]) for r in t.records]
    with t:  # entered again: a fresh list of records
        dist.all_reduce(x, group=mesh.get_group("dp"))
    return x, first, [(r["seq"], r["group"], r["group_size"]) for r in t.records]


def test_groups_are_named_by_mesh_dim_and_a_trace_can_be_reentered(tp_lab):
    if tp_lab.world_size != 4:
        pytest.skip("a (dp=2, tp=2) mesh needs 4 ranks")
    for x, first, second in tp_lab.run(_two_d_mesh_and_reentry):
        assert first == [("tp", 2)] and second == [(0, "dp", 2)]
        # tp pairs {0,1}, {2,3} sum to 3 and 7; then dp pairs {0,2}, {1,3} sum those
        assert x.tolist() == [10.0, 10.0]
