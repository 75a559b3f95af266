"""tplab.cost: the alpha-beta model against hand-computed cases, its identities, the
transformer formulas, and (on the lab) calibration and bytes equality with traces."""

from __future__ import annotations

import math

import pytest

from tplab import LabError, cost
from tplab.cost import BlockShape, Hardware, Link
from tplab.cost.calibrate import fit_line

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
    with pytest.raises(ValueError, match="op must be one of"):
        cost.collective_time("allreduce", 1, 2, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        cost.collective_time("all_reduce", 1, 2, LINK, "butterfly")


def test_hardware_uses_nvlink_inside_a_node_and_striped_nics_beyond():
    hw = cost.HARDWARE["H100 SXM"]
    assert hw.link(8) is hw.intra and hw.intra.bandwidth == 370e9    # nccl-tests #212
    across = hw.link(16)
    assert across.name == "8 x InfiniBand NDR (nccl-tests)"
    assert across.bandwidth == min(450e9, 8 * 48e9) == 384e9         # 8 NICs bind (#319)
    assert hw.with_(nics_per_node=1).link(16).bandwidth == 48e9      # the old one-NIC model
    assert hw.with_(nics_per_node=4).link(16).bandwidth == 4 * 48e9
    assert cost.HARDWARE["A100 SXM"].link(16).bandwidth == 8 * 24e9  # 192 GB/s (nccl #812)
    t8 = cost.collective_time("all_reduce", 2**26, 8, hw)
    t16 = cost.collective_time("all_reduce", 2**26, 16, hw)
    one_nic = cost.collective_time("all_reduce", 2**26, 16, hw.with_(nics_per_node=1))
    assert t8 < t16 < 1.5 * t8 < 5 * t8 < one_nic   # the cliff was the single NIC


def test_every_call_pays_the_base_latency():
    link = Link("based", 1e9, 1e-6, base_latency=5e-6)
    assert cost.collective_terms("all_reduce", 8e6, 4, link) == pytest.approx((11e-6, 12e-3))
    assert cost.collective_terms("all_gather", 8, 4, link)[0] == pytest.approx(8e-6)
    assert cost.collective_time("all_reduce", 8e6, 1, link) == 0
    assert cost.LINKS["NVLink 4 (nccl-tests)"].base_latency == 8.4e-6   # tuning.cc baseLat


def test_nvls_reduces_in_the_switch():
    link = Link("nvswitch", 1e9, 1e-6, base_latency=5e-6, nvls_bandwidth=2e9)
    # 2 steps (into the switch, multicast back), bytes at the NVLS bus bandwidth
    nvls = cost.collective_terms("all_reduce", 8e6, 4, link, "nvls")
    assert nvls == pytest.approx((7e-6, 2 * 8e6 * 3 / 4 / 2e9))
    assert cost.collective_time("all_reduce", 8e6, 4, link, "auto") == pytest.approx(sum(nvls))
    with pytest.raises(ValueError, match="nvls_bandwidth"):
        cost.collective_time("all_reduce", 8e6, 4, LINK, "nvls")
    hw = cost.HARDWARE["H100 SXM"]
    with pytest.raises(ValueError, match="no such all_reduce"):
        cost.collective_time("all_reduce", 8e6, 16, hw, "nvls")   # NVLS: one node only
    # across nodes "auto" takes ring, tree or NVLSTree (NVLS in each node, a tree of the
    # nodes: NCCL 2.21.5); inside, NVLS wins for large messages
    assert cost.collective_time("all_reduce", 2**26, 16, hw, "auto") == min(
        cost.collective_time("all_reduce", 2**26, 16, hw, a)
        for a in ("ring", "tree", "nvls_tree"))
    assert cost.collective_time("all_reduce", 2**26, 8, hw, "nvls") < cost.collective_time(
        "all_reduce", 2**26, 8, hw)
    # a sweep takes it with "auto" where it exists (inside the node), the ring beyond
    shape = cost.MODELS["Llama-3 70B"]   # 64 MiB messages: NVLS pays (32 MiB: not yet)
    auto, ring = (cost.sweep(shape, hw, (8, 16), algorithm=a) for a in ("auto", "ring"))
    assert auto[0]["tp_comm_s"] < ring[0]["tp_comm_s"]
    assert auto[1]["tp_comm_s"] <= ring[1]["tp_comm_s"]
    # gather and scatter ops never use it
    assert cost.collective_terms("all_gather", 8e6, 4, link, "nvls") == cost.collective_terms(
        "all_gather", 8e6, 4, link)


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
    assert cost.records_time(sp, LINK) == pytest.approx(cost.records_time(tp, LINK))
    # ... except that twice the calls pay NCCL's base latency twice: 4 more per block (16 KiB
    # messages take the LL protocol, whose baseLat is 6.6 us: tuning.cc)
    hw = cost.HARDWARE["H100 SXM"]
    assert cost.records_time(sp, hw) - cost.records_time(tp, hw) == pytest.approx(4 * 6.6e-6)


def test_step_time_by_hand():
    hw = Hardware("toy", flops=1e12, intra=FREE, inter=FREE, gpus_per_node=8)
    shape = BlockShape(hidden=8, heads=2, kv_heads=1, ffn=12, gated=True, seq=3, layers=5,
                       dtype_bytes=2)
    row = cost.step_time(shape, 2, hw, mfu=1.0, gemm="flat")
    # causal attention (the default) computes half of the 4 b s^2 h = 288 score FLOPs
    assert row["compute_s"] == pytest.approx(5 * 3 * (3168 - 288 / 2) / (2 * 1e12))
    assert cost.step_time(shape, 2, hw, mfu=1.0, gemm="flat", causal=False)[
        "compute_s"] == pytest.approx(5 * 3 * 3168 / (2 * 1e12))
    assert row["mfu"] == pytest.approx(1.0)
    # 4 all-reduces of 3*8*2 = 48 bytes on 2 ranks: 4 * 2 * 48 * 1/2 / 1e9 per layer; and
    # TP 2 > 1 KV head: Megatron all-gathers the QKV output, 3 * (8 + 2 * 4) * 2 = 96 bytes,
    # and reduce-scatters its gradient: 2 * 96 * 1/2 / 1e9
    assert row["kv_replicated"]
    assert row["tp_comm_s"] == pytest.approx(5 * (4 * 48 + 96) / 1e9) == row["exposed_comm_s"]
    assert row["step_s"] == pytest.approx(row["compute_s"] + row["tp_comm_s"])
    assert row["tokens_per_s_per_gpu"] == pytest.approx(3 / (row["step_s"] * 2))
    assert row["gpu_s"] == pytest.approx(2 * row["step_s"])
    # compute at the default MFU (Llama 3: 38-43%) takes 1/0.4 as long
    assert cost.MFU == 0.40
    assert cost.step_time(shape, 2, hw, gemm="flat")["compute_s"] == pytest.approx(
        row["compute_s"] / 0.4)
    with pytest.raises(ValueError, match="mfu"):
        cost.step_time(shape, 2, hw, mfu=1.5)


def test_step_time_counts_the_lm_head_and_causal_attention():
    hw = Hardware("toy", flops=1e12, intra=FREE, inter=FREE, gpus_per_node=8)
    shape = BlockShape(hidden=8, heads=2, kv_heads=1, ffn=12, gated=True, seq=3, layers=5,
                       dtype_bytes=2, vocab=10)
    assert cost.lm_head_flops(shape) == 2 * 3 * 8 * 10
    assert cost.block_flops(shape, causal=True) == 3168 - 144
    row = cost.step_time(shape, 2, hw, mfu=1.0, gemm="flat")
    # the head on 2 ranks: 5 of the 10 vocabulary rows each, 3 passes of 2 * 3 * 8 * 5
    assert row["lm_head_s"] == pytest.approx(3 * 240 / 1e12)
    assert row["compute_s"] == pytest.approx((5 * 3 * 3024 / 2 + 3 * 240) / 1e12)
    assert row["mfu"] == pytest.approx(1.0)             # the head's FLOPs count as model FLOPs
    # 3 ranks (the heads allow it here: 1 KV head replicated) round 10 / 3 rows up to 4
    assert cost.step_time(shape.with_(heads=3, hidden=9), 3, hw, mfu=1.0, gemm="flat")[
        "lm_head_s"] == pytest.approx(3 * 2 * 3 * 9 * 4 / 1e12)
    off = cost.step_time(shape, 2, hw, mfu=1.0, gemm="flat", lm_head=False)
    assert off["lm_head_s"] == 0 and off["compute_s"] == pytest.approx(5 * 3 * 3024 / 2e12)
    mlp = cost.step_time(shape, 2, hw, mfu=1.0, gemm="flat", sublayers=("mlp",))
    assert mlp["lm_head_s"] == 0                        # a sub-layer alone has no head
    for bad in ("yes", 1):
        with pytest.raises(TypeError, match="causal"):
            cost.step_time(shape, 2, hw, causal=bad)


# a block whose messages are 48 bytes (3 tokens x 8 x 2 bytes) on a slow link: each
# all-reduce over 2 ranks takes 2 * 48 * 1/2 / 1e8 = 480 ns; at 1 GFLOP/s, 2 ranks:
# the MLP's w1 GEMM (2 * 3 * 8 * 12 = 576 FLOPs) takes 288 ns, q, k, v (1152) 576 ns
SLOW = Hardware("slow", flops=1e9, intra=Link("slow", 1e8, 0.0), inter=Link("slow", 1e8, 0.0))
SMALL = BlockShape(hidden=8, heads=4, ffn=12, seq=3, dtype_bytes=2)


def test_megatron_overlap_hides_the_backward_all_reduce_behind_the_weight_gradient():
    none = cost.step_time(SMALL, 2, SLOW, mfu=1.0, gemm="flat")
    mg = cost.step_time(SMALL, 2, SLOW, mfu=1.0, overlap="megatron", gemm="flat")
    assert none["tp_comm_s"] == pytest.approx(4 * 480e-9) == mg["tp_comm_s"]
    assert none["exposed_comm_s"] == none["tp_comm_s"]
    # forward g: 2 x 480 ns exposed; backward f of the MLP: 480 - 288; of attention: hidden
    assert mg["exposed_comm_s"] == pytest.approx(2 * 480e-9 + (480e-9 - 288e-9))
    assert mg["hidden_comm_s"] == pytest.approx(288e-9 + 480e-9)
    assert mg["step_s"] == pytest.approx(mg["compute_s"] + mg["exposed_comm_s"])
    recs = cost.comm_times(SMALL, 2, SLOW, overlap="megatron", mfu=1.0, gemm="flat")
    assert [(r["phase"], r["hidden_by"]) for r in recs] == [
        ("forward", None), ("forward", None), ("backward", "col_wgrad"),
        ("backward", "col_wgrad")]
    assert [r["gemm_s"] for r in recs[2:]] == pytest.approx([288e-9, 576e-9])


def test_sp_saves_the_shard_and_gathers_it_again_for_a_quarter_more_bytes():
    gathered = cost.block_collectives(SMALL, 2, sequence_parallel=True)
    shard = cost.block_collectives(SMALL, 2, sequence_parallel=True, sp_saves="shard")
    assert len(gathered) == 8 and len(shard) == 10
    assert sum(r["bytes"] for r in shard) == 1.25 * sum(r["bytes"] for r in gathered)
    assert [r["role"] for r in shard if r["phase"] == "backward"] == [
        "bwd_out", "regather", "bwd_in"] * 2
    # Megatron hides the re-gather behind the input-gradient GEMM (q, k, v: 576 ns, w1:
    # 288 ns) and the reduce-scatters of dx behind the weight-gradient GEMMs
    t = 240e-9          # an all-gather or reduce-scatter of 48 bytes over 2 ranks
    mg = cost.step_time(SMALL, 2, SLOW, True, mfu=1.0, overlap="megatron", sp_saves="shard",
                        gemm="flat")
    assert mg["tp_comm_s"] == pytest.approx(10 * t)
    assert mg["exposed_comm_s"] == pytest.approx(4 * t + 2 * t)   # forward 4, bwd_out 2
    # memory: the two region inputs (h x d bytes per token each) are kept 1/t
    shape = cost.MODELS["Llama-3 8B"]
    mem = {s: cost.gpu_memory(shape, 8, True, sp_saves=s)["activation_bytes"]
           for s in ("gathered", "shard")}
    assert mem["gathered"] - mem["shard"] == pytest.approx(
        shape.layers * 2 * shape.tokens * shape.hidden * 2 * (1 - 1 / 8))
    with pytest.raises(ValueError, match="sp_saves"):
        cost.block_collectives(SMALL, 2, True, sp_saves="both")


def test_async_tp_hides_every_sp_collective_inside_the_node_only():
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        cost.step_time(SMALL, 2, SLOW, overlap="async_tp")
    fast = Hardware("fast", 1e9, Link("nv", 1e10, 0.0), Link("nic", 1e10, 0.0), 2)
    row = cost.step_time(SMALL, 2, fast, True, mfu=1.0, overlap="async_tp", gemm="flat")
    assert row["exposed_comm_s"] == 0 and row["tp_comm_s"] > 0   # every GEMM outlasts its
    across = cost.step_time(SMALL, 4, fast, True, mfu=1.0, overlap="async_tp",
                           gemm="flat")   # 2 nodes
    assert across["exposed_comm_s"] == across["tp_comm_s"] and "NVLink domain" in across[
        "overlap"]
    with pytest.raises(ValueError, match="overlap"):
        cost.step_time(SMALL, 2, SLOW, overlap="always")


def test_best_tp_for_latency_or_throughput_within_memory():
    hw = cost.HARDWARE["H100 SXM"]
    rows = cost.sweep(cost.MODELS["Llama-3 8B"], hw)
    per_gpu = [r["tokens_per_s_per_gpu"] for r in rows]
    assert per_gpu == sorted(per_gpu, reverse=True)           # GPU-ms rise from TP 1
    assert cost.best_tp(rows) == cost.best_tp(rows, "throughput") == 1   # the default
    assert cost.best_tp(rows, "latency") == min(
        rows, key=lambda r: r["step_s"])["tp"] > 8           # 8 NICs: faster across nodes
    # within 80 GB (no optimizer sharding), the first that fits is the best throughput
    fits = [r["tp"] for r in rows if r["memory_bytes"] <= hw.usable_memory]
    assert cost.best_tp(rows, "throughput", hw.usable_memory) == fits[0]
    toy = [{"tp": 1, "step_s": 4.0, "tokens_per_s_per_gpu": 10.0, "memory_bytes": 9},
           {"tp": 2, "step_s": 2.0, "tokens_per_s_per_gpu": 10.0, "memory_bytes": 5},
           {"tp": 4, "step_s": 1.5, "tokens_per_s_per_gpu": 6.0, "memory_bytes": 3}]
    assert cost.best_tp(toy, "throughput") == 1               # a tie: the smaller degree
    assert cost.best_tp(toy, "throughput", memory_limit=6) == 2
    assert cost.best_tp(toy, "latency", memory_limit=6) == 4
    with pytest.raises(ValueError, match="objective"):
        cost.best_tp(toy, "cost")
    with pytest.raises(ValueError, match="tokens_per_s_per_gpu"):
        cost.best_tp([{"tp": 1, "step_s": 1.0}], "throughput")
    with pytest.raises(ValueError, match="rows is empty"):
        cost.best_tp([])
    with pytest.raises(ValueError, match="memory_limit"):
        cost.best_tp(toy, memory_limit=float("nan"))


def test_zero_shards_the_model_states_over_dp():
    shape = cost.MODELS["Llama-3 70B"]
    plain = cost.gpu_memory(shape, 8)
    for zero, sharded in ((1, ("optimizer_bytes",)), (2, ("optimizer_bytes", "grad_bytes")),
                          (3, ("optimizer_bytes", "grad_bytes", "param_bytes"))):
        row = cost.gpu_memory(shape, 8, dp=64, zero=zero)
        n = plain["param_bytes"] / 2
        # stage 3 keeps the fp32 shard as the master: 4 + 4 + 8 bytes over 64, not 2 + 4 + 12
        whole = ({"param_bytes": 4 * n, "optimizer_bytes": 8 * n} if zero == 3 else {})
        for key in ("optimizer_bytes", "grad_bytes", "param_bytes"):
            assert row[key] == pytest.approx(whole.get(key, plain[key])
                                             / (64 if key in sharded else 1))
        assert row["activation_bytes"] == plain["activation_bytes"]
    with pytest.raises(ValueError, match="ZeRO stage"):
        cost.gpu_memory(shape, 8, dp=2, zero=4)


@pytest.mark.parametrize("gated", [False, True])
def test_closed_form_mlp_ratio_agrees_with_the_model(gated):
    hw = cost.HARDWARE["H100 SXM"].with_(intra=Link("nv", 450e9, 0.0))
    shape = BlockShape(hidden=4096, heads=32, ffn=11008, gated=gated)
    for tp in (2, 4, 8):
        row = cost.step_time(shape, tp, hw, sublayers=("mlp",), gemm="flat")
        assert row["tp_comm_s"] / row["compute_s"] == pytest.approx(
            cost.mlp_comm_ratio(shape, tp, hw))


def test_where_tp_stops_paying_moves_with_the_nics():
    hw = cost.HARDWARE["H100 SXM"]
    for name in ("Llama-3 8B", "Llama-3 70B"):
        shape = cost.MODELS[name]
        one_nic = cost.sweep(shape, hw.with_(nics_per_node=1))
        by_tp = {r["tp"]: r for r in one_nic}
        assert [r["step_s"] for r in one_nic[:4]] == sorted((r["step_s"] for r in one_nic[:4]),
                                                            reverse=True)
        assert by_tp[16]["step_s"] > by_tp[8]["step_s"] and by_tp[16]["crosses_nodes"]
        assert cost.best_tp(one_nic, "latency") == 8        # the old verdict: one NIC per ring
        assert cost.best_tp(cost.sweep(shape, hw), "latency") > 8   # 8 striped NICs: further
    # a bigger hidden size stays compute-bound further on a single fabric
    nvlink_only = hw.with_(gpus_per_node=1024)
    share = {name: cost.step_time(cost.MODELS[name], 16, nvlink_only)["comm_fraction"]
             for name in ("Llama-3 8B", "Llama-3 70B")}
    assert share["Llama-3 70B"] < share["Llama-3 8B"]


def test_scaled_keeps_head_width_and_ffn_ratio():
    base = cost.MODELS["Llama-3 70B"]
    half = cost.scaled(base, 4096, seq=1024)
    assert (half.hidden, half.heads, half.kv_heads, half.ffn, half.seq) == (4096, 32, 8, 14336,
                                                                             1024)


# --- the explorer and its figure ----------------------------------------------------------

def test_explorer_is_driven_from_code():
    from tplab.cost.explorer import CostExplorer

    ex = CostExplorer()
    assert ex.best_tp == cost.best_tp(ex.rows) and [r["tp"] for r in ex.rows] == [
        1, 2, 4, 8, 16, 32, 64]
    assert ex.fastest_tp == cost.best_tp(ex.rows, "latency")
    assert ex.fits_tp == cost.best_tp(ex.rows, memory_limit=ex.hw.usable_memory)
    assert "Training" in ex.summary.value and "latency" in ex.summary.value
    ex.update(hardware="A100 SXM", gpus_per_node=64)
    assert ex.fastest_tp > 8
    ex.update(hardware="A100 SXM")          # back to the preset's 8 GPUs per node
    assert ex.hw.gpus_per_node == 8 and ex.best_tp == cost.best_tp(ex.rows)
    ex.update(model="Llama-3 8B")           # 32 query heads: no TP 64
    assert [r["tp"] for r in ex.rows] == [1, 2, 4, 8, 16, 32]
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
    assert len(fastest) == 1 and fastest[0].x == [r["tp"] for r in ex.rows].index(
        ex.fastest_tp)


# --- calibration --------------------------------------------------------------------------

def test_fit_recovers_a_noiseless_line_and_never_a_negative_latency():
    xs = [2.0**k for k in range(10, 25)]
    a, b = fit_line(xs, [3e-4 + 2e-9 * x for x in xs])
    assert a == pytest.approx(3e-4) and b == pytest.approx(2e-9)
    big = [x for x in xs if x > 1e5]
    a, b = fit_line(big, [-1e-5 + 1e-9 * x for x in big])
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
