"""tplab.cost: the alpha-beta model against hand-computed cases, its identities, the
transformer formulas, and (on the lab) calibration and bytes equality with traces."""

from __future__ import annotations

import math

import pytest

from tplab import LabError, cost
from tplab.cost import BlockShape, Hardware, Link
from tplab.cost.calibrate import _fit

LINK = Link("test", bandwidth=1e9, latency=1e-6)          # 1 GB/s, 1 us per step
FREE = Link("no latency", bandwidth=1e9, latency=0.0)


# --- one collective ---------------------------------------------------------------------

def test_ring_times_match_hand_computed_values():
    # 8 MB over 4 ranks: each rank sends 3/4 of it once (AG, RS) or twice (AR)
    assert cost.collective_terms("all_gather", 8e6, 4, LINK) == pytest.approx((3e-6, 6e-3))
    assert cost.collective_terms("reduce_scatter", 8e6, 4, LINK) == pytest.approx((3e-6, 6e-3))
    assert cost.collective_terms("all_reduce", 8e6, 4, LINK) == pytest.approx((6e-6, 12e-3))
    assert cost.collective_terms("all_to_all", 8e6, 4, LINK) == pytest.approx((3e-6, 6e-3))
    assert cost.collective_time("all_reduce", 8e6, 4, LINK) == pytest.approx(12.006e-3)


def test_tree_all_reduce_has_log_latency_and_full_bytes():
    # 8 ranks: 2 * log2(8) = 6 steps; bytes term 2 * nbytes / B
    assert cost.collective_terms("all_reduce", 8e6, 8, LINK, "tree") == pytest.approx(
        (6e-6, 16e-3))


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("nbytes", [1, 4096, 2**20, 3 * 10**8])
def test_all_reduce_is_reduce_scatter_plus_all_gather(n, nbytes):
    ar = cost.collective_terms("all_reduce", nbytes, n, LINK)
    rs = cost.collective_terms("reduce_scatter", nbytes, n, LINK)
    ag = cost.collective_terms("all_gather", nbytes, n, LINK)
    assert ar == pytest.approx((rs[0] + ag[0], rs[1] + ag[1]))


def test_time_grows_with_bytes_and_ranks():
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        times = [cost.collective_time(op, 2**k, 8, LINK) for k in range(10, 30)]
        assert all(a < b for a, b in zip(times, times[1:], strict=False))
        by_n = [cost.collective_time(op, 2**20, n, LINK) for n in (2, 4, 8, 16, 64)]
        assert all(a < b for a, b in zip(by_n, by_n[1:], strict=False))
    # the bytes term of a ring tends to a limit: twice the message over the bandwidth
    assert cost.collective_terms("all_reduce", 1e9, 1024, FREE)[1] < 2.0


def test_auto_takes_the_tree_for_small_messages_on_many_ranks_and_the_ring_for_large():
    for nbytes, n in [(1024, 64), (1e9, 8), (1e6, 512)]:
        ring = cost.collective_time("all_reduce", nbytes, n, LINK, "ring")
        tree = cost.collective_time("all_reduce", nbytes, n, LINK, "tree")
        assert cost.collective_time("all_reduce", nbytes, n, LINK, "auto") == min(ring, tree)
    assert cost.collective_time("all_reduce", 1024, 64, LINK, "tree") < cost.collective_time(
        "all_reduce", 1024, 64, LINK, "ring")
    assert cost.collective_time("all_reduce", 1e9, 8, LINK, "ring") < cost.collective_time(
        "all_reduce", 1e9, 8, LINK, "tree")


def test_one_rank_costs_nothing_and_bad_names_are_refused():
    assert cost.collective_time("all_reduce", 1e9, 1, LINK) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        cost.collective_time("allreduce", 1, 2, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        cost.collective_time("all_reduce", 1, 2, LINK, "butterfly")


def test_hardware_uses_nvlink_inside_a_node_and_infiniband_beyond():
    hw = cost.HARDWARE["H100 SXM"]
    assert hw.link(8).name == "NVLink 4" and hw.link(16).name == "InfiniBand NDR"
    t8 = cost.collective_time("all_reduce", 2**26, 8, hw)
    t16 = cost.collective_time("all_reduce", 2**26, 16, hw)
    assert t16 > 5 * t8   # 450 GB/s against 50 GB/s


def test_presets_are_faster_inside_a_node_than_between_nodes():
    for hw in cost.HARDWARE.values():
        assert hw.intra.bandwidth >= hw.inter.bandwidth
        assert hw.intra.latency <= hw.inter.latency
    assert (cost.LINKS["NVLink 4"].bandwidth > cost.LINKS["NVLink 3"].bandwidth
            > cost.LINKS["PCIe Gen5 x16"].bandwidth > cost.LINKS["PCIe Gen4 x16"].bandwidth)


def test_per_op_parameters_override_the_link():
    link = Link("fitted", 1e9, 1e-6, per_op={"all_gather": (2e-6, 2e9)})
    assert cost.collective_terms("all_gather", 8e6, 4, link) == pytest.approx((6e-6, 3e-3))
    assert cost.collective_terms("reduce_scatter", 8e6, 4, link) == pytest.approx((3e-6, 6e-3))


def test_records_time_counts_one_rank_of_a_trace():
    recs = [{"rank": r, "op": "all_reduce", "bytes": 8e6, "group_size": 4} for r in range(4)]
    assert cost.records_time(recs, LINK) == pytest.approx(12.006e-3)
    assert cost.records_time(recs + recs[:1], LINK) == pytest.approx(2 * 12.006e-3)


# --- a transformer block ------------------------------------------------------------------

def test_block_flops_match_narayanan_for_a_gpt_shape():
    b, s, h = 2, 512, 1024
    shape = BlockShape(hidden=h, heads=16, seq=s, batch=b)
    assert cost.block_flops(shape) == 24 * b * s * h**2 + 4 * b * s**2 * h


def test_block_flops_count_grouped_query_attention_and_a_gated_mlp():
    # h=8, 2 heads of 4, 1 kv head, f=12 gated, 3 tokens, by hand:
    # qkv 2*3*8*(8+4+4)=768, out 2*3*8*8=384, scores 4*1*9*8=288, mlp 2*3*8*12*3=1728
    shape = BlockShape(hidden=8, heads=2, kv_heads=1, ffn=12, gated=True, seq=3)
    assert cost.block_flops(shape) == 768 + 384 + 288 + 1728
    assert cost.block_flops(shape, ("mlp",)) == 1728


def test_block_collectives_tp_and_sequence_parallel():
    shape = BlockShape(hidden=64, heads=4, seq=32, batch=2, dtype_bytes=4)
    T = 2 * 32 * 64 * 4
    tp = cost.block_collectives(shape, 4)
    assert [(r["phase"], r["op"]) for r in tp] == [("forward", "all_reduce")] * 2 + [
        ("backward", "all_reduce")] * 2
    assert [r["module"] for r in tp] == ["attention", "mlp", "mlp", "attention"]
    sp = cost.block_collectives(shape, 4, sequence_parallel=True)
    for phase in ("forward", "backward"):
        ops = sorted(r["op"] for r in sp if r["phase"] == phase)
        assert ops == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert all(r["bytes"] == T and r["group_size"] == 4 for r in tp + sp)
    assert cost.block_collectives(shape, 1) == []
    # same bytes, same time: SP saves memory, not communication (Korthikanti et al. 2022)
    for link in (LINK, cost.HARDWARE["H100 SXM"]):
        assert cost.records_time(sp, link) == pytest.approx(cost.records_time(tp, link))


def test_step_time_by_hand():
    hw = Hardware("toy", flops=1e12, intra=FREE, inter=FREE, gpus_per_node=8)
    shape = BlockShape(hidden=8, heads=2, kv_heads=1, ffn=12, gated=True, seq=3, layers=5,
                       dtype_bytes=2)
    row = cost.step_time(shape, 2, hw)
    assert row["compute_s"] == pytest.approx(5 * 3 * 3168 / (2 * 1e12))
    # 4 all-reduces of 3*8*2 = 48 bytes on 2 ranks: 4 * 2 * 48 * 1/2 / 1e9 per layer
    assert row["tp_comm_s"] == pytest.approx(5 * 4 * 48 / 1e9)
    assert row["step_s"] == pytest.approx(row["compute_s"] + row["tp_comm_s"])


@pytest.mark.parametrize("gated", [False, True])
def test_closed_form_mlp_ratio_agrees_with_the_model(gated):
    hw = cost.HARDWARE["H100 SXM"].with_(intra=Link("nv", 450e9, 0.0))
    shape = BlockShape(hidden=4096, heads=32, ffn=11008, gated=gated)
    for tp in (2, 4, 8):
        row = cost.step_time(shape, tp, hw, sublayers=("mlp",))
        assert row["tp_comm_s"] / row["compute_s"] == pytest.approx(
            cost.mlp_comm_ratio(shape, tp, hw))


def test_tp_stops_paying_where_it_leaves_the_node():
    hw = cost.HARDWARE["H100 SXM"]
    for name in ("Llama-3 8B", "Llama-3 70B"):
        rows = cost.sweep(cost.MODELS[name], hw)
        by_tp = {r["tp"]: r for r in rows}
        assert [r["step_s"] for r in rows[:4]] == sorted((r["step_s"] for r in rows[:4]),
                                                         reverse=True)
        assert by_tp[16]["step_s"] > by_tp[8]["step_s"] and by_tp[16]["crosses_nodes"]
        assert cost.best_tp(rows) == 8
        assert cost.comm_bound_tp(cost.MODELS[name], hw) == 16
    # a bigger hidden size stays compute-bound further on a single fabric
    nvlink_only = hw.with_(gpus_per_node=1024)
    assert cost.comm_bound_tp(cost.MODELS["Llama-3 70B"], nvlink_only) > cost.comm_bound_tp(
        cost.MODELS["Llama-3 8B"], nvlink_only)


def test_scaled_keeps_head_width_and_ffn_ratio():
    base = cost.MODELS["Llama-3 70B"]
    half = cost.scaled(base, 4096, seq=1024)
    assert (half.hidden, half.heads, half.kv_heads, half.ffn, half.seq) == (4096, 32, 8, 14336,
                                                                             1024)


# --- the explorer and its figure ----------------------------------------------------------

def test_explorer_is_driven_from_code():
    from tplab.cost.explorer import CostExplorer

    ex = CostExplorer()
    assert ex.best_tp == 8 and [r["tp"] for r in ex.rows] == [1, 2, 4, 8, 16, 32, 64]
    ex.update(gpus_per_node=64)
    assert ex.best_tp > 8
    ex.update(hardware="A100 SXM")          # back to the preset's 8 GPUs per node
    assert ex.hw.gpus_per_node == 8 and ex.best_tp == 8
    ex.update(model="Llama-3 8B", hidden=8192)
    assert ex.shape.hidden == 8192 and ex.shape.ffn == 2 * 14336 and ex.shape.layers == 32
    with pytest.raises(ValueError, match="no control"):
        ex.update(bandwidth=1)
    with pytest.raises(ValueError, match="no hardware named"):
        ex.update(hardware="TPU v5p")
    ex.update(hidden=3072)                  # a size the dropdown did not offer
    assert ex.shape.hidden == 3072 and ex.shape.heads == 24
    bars = [t for t in ex.figure.data if t.type == "bar"]
    assert [t.name for t in bars] == ["compute", "TP communication"]
    assert list(bars[1].y) == pytest.approx([r["tp_comm_s"] * 1e3 for r in ex.rows])
    fastest = [a for a in ex.figure.layout.annotations if a.text == "fastest"]
    assert len(fastest) == 1 and fastest[0].x == [r["tp"] for r in ex.rows].index(ex.best_tp)


# --- calibration --------------------------------------------------------------------------

def test_fit_recovers_a_noiseless_line_and_never_a_negative_latency():
    xs = [2.0**k for k in range(10, 25)]
    a, b = _fit(xs, [3e-4 + 2e-9 * x for x in xs])
    assert a == pytest.approx(3e-4) and b == pytest.approx(2e-9)
    big = [x for x in xs if x > 1e5]
    a, b = _fit(big, [-1e-5 + 1e-9 * x for x in big])
    assert a == 0 and b > 0


def test_calibrate_refuses_a_simulated_lab():
    simulate = pytest.importorskip("tplab.lab.simulate")
    sim = simulate.simulate(2)
    with pytest.raises(LabError, match="real rank processes"):
        cost.calibrate(sim, sizes=(1024, 2048), repeats=1)


@pytest.mark.slow
def test_calibrate_on_real_ranks(labs):
    lab = labs.get(2)
    sizes = tuple(2**k for k in (12, 16, 18, 20, 24))
    cal = cost.calibrate(lab, sizes=sizes, ops=("all_reduce", "all_gather"), repeats=5,
                         warmup=1, matmul_n=128)
    assert cal.backend == "gloo" and cal.world_size == 2 and cal.flops > 1e8
    assert set(cal.fits) == {"all_reduce", "all_gather"}
    assert all(f["alpha"] >= 0 and f["bandwidth"] > 0 for f in cal.fits.values())
    held = cal.held_out()
    assert len(cal.rows) == 10 and [r["bytes"] for r in held] == [2**16, 2**20] * 2
    for op in cal.fits:   # 16 MiB take longer than 4 KiB, measured and fitted
        rows = [r for r in cal.rows if r["op"] == op]
        assert rows[-1]["measured_s"] > rows[0]["measured_s"]
        assert rows[-1]["predicted_s"] > rows[0]["predicted_s"]
    hw = cal.hardware
    assert hw.name == "this machine" and hw.link(2) is hw.intra
    assert cost.collective_time("all_gather", 2**20, 2, hw) == pytest.approx(
        next(r["predicted_s"] for r in cal.rows if r["op"] == "all_gather"
             and r["bytes"] == 2**20))
    assert math.isfinite(cal.median_error(0))


# --- the lab's own models: predicted bytes against traced bytes ---------------------------

LAB_CASES = [("mlp", "megatron", False), ("mlp", "megatron", True), ("mlp", "dtensor", False),
             ("block", "megatron", False), ("block", "megatron", True),
             ("block", "dtensor", False), ("block", "dtensor", True)]


def traced_steps(cases, cfg):
    """Rank side: one forward and backward of each case under tplab.trace."""
    import torch

    import tplab
    from tplab import megatron, models, plans

    mesh = tplab.make_mesh(tp=torch.distributed.get_world_size())
    out = {}
    for kind, plan, sp in cases:
        model = (models.MLP if kind == "mlp" else models.Block)(cfg)
        if plan == "megatron":
            model = megatron.parallelize(model, mesh, sequence_parallel=sp)
        else:
            model = tplab.apply_plan(model, mesh, plans.mlp() if kind == "mlp" else
                                     plans.block(sp))
        x = models.make_input(cfg).requires_grad_()
        with tplab.trace() as t:
            model(x).sum().backward()
        out[(kind, plan, sp)] = ([(r["phase"], r["op"], r["bytes"], r["group_size"])
                                  for r in t.records], t.bytes())
    return out


def check_against_traces(per_rank, cfg, world_size):
    from tplab.cost.lab_models import lab_collectives

    for case in LAB_CASES:
        predicted = lab_collectives(case[0], cfg, world_size, case[2], case[1])
        assert predicted, case
        totals = {"forward": {}, "backward": {}}
        for r in predicted:
            totals[r["phase"]][r["op"]] = totals[r["phase"]].get(r["op"], 0) + r["bytes"]
        for rank, result in enumerate(per_rank):
            records, traced_bytes = result[case]
            assert records == [(r["phase"], r["op"], r["bytes"], r["group_size"])
                               for r in predicted], (case, rank)
            assert traced_bytes == totals, (case, rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_predicted_bytes_equal_traced_bytes_simulated(world_size):
    simulate = pytest.importorskip("tplab.lab.simulate")
    from tplab import models

    cfg = models.Config()
    per_rank = simulate.simulate(world_size).run(traced_steps, LAB_CASES, cfg)
    check_against_traces(per_rank, cfg, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_predicted_bytes_equal_traced_bytes_on_real_ranks(labs, world_size):
    from tplab import models

    cfg = models.Config(dim=48, hidden_dim=96, seq_len=12, batch_size=3)
    check_against_traces(labs.get(world_size).run(traced_steps, LAB_CASES, cfg), cfg,
                         world_size)


def test_lab_collectives_refuses_what_the_lab_does_not_have():
    from tplab.cost.lab_models import lab_collectives

    cfg = type("Cfg", (), {"dim": 8, "n_heads": 2, "hidden_dim": 16, "seq_len": 4,
                           "batch_size": 1})()
    with pytest.raises(ValueError, match="no sequence-parallel plan"):
        lab_collectives("mlp", cfg, 2, True, "dtensor")
    with pytest.raises(ValueError, match="knows"):
        lab_collectives("TinyLM", cfg, 2)
    assert lab_collectives("block", cfg, 1) == []
