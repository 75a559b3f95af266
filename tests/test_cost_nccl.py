"""tplab.cost against hand-computed values of NCCL 2.21.5's tuning model (src/graph/tuning.cc:
baseLat, hwLat, the protocols' bandwidth efficiencies and caps), the heads and KV checks,
Megatron's QKV gather past n_kv_heads, the GEMM model and the data-parallel traffic. Every
expected number is computed here from the constants of tuning.cc, not by tplab's code."""

from __future__ import annotations

import math

import pytest

from tplab import cost
from tplab.cost import BlockShape, collective_plan, kernels

H100 = cost.HARDWARE["H100 SXM"]
A100 = cost.HARDWARE["A100 SXM"]
MiB = 2**20
US = 1e-6


def plan(*args, **kw):
    return collective_plan(*args, **kw)


# --- one node: ring LL / LL128 / Simple, tree, NVLS ----------------------------------------

@pytest.mark.parametrize("protocol, base, step, bus", [
    ("Simple", 8.4, 3.4, 370e9),                  # B
    ("LL128", 14.0, 1.9, 0.92 * 370e9),           # 0.92 B (2 or more GPUs per node)
    ("LL", 6.6, 0.6, 141e9),                      # min(llMax Hopper 141 GB/s, B / 2)
])
def test_ring_all_reduce_per_protocol_by_hand(protocol, base, step, bus):
    n, nbytes = 8, 64 * MiB
    p = plan("all_reduce", nbytes, n, H100, "ring", protocol)
    assert p["latency_s"] == pytest.approx((base + 2 * (n - 1) * step) * US)
    # algorithm bandwidth = bus x N / nsteps, nsteps = 2 (N-1)
    assert p["bytes_s"] == pytest.approx(nbytes / (bus * n / (2 * (n - 1))))
    assert (p["algorithm"], p["protocol"]) == ("ring", protocol)


def test_the_issue_numbers_64_mib_simple_56_us_and_32_kib_ll_15_us():
    big = plan("all_reduce", 64 * MiB, 8, H100)
    assert big["protocol"] == "Simple" and big["latency_s"] == pytest.approx(56.0 * US)
    small = plan("all_reduce", 32 * 2**10, 8, H100)
    assert small["protocol"] == "LL" and small["latency_s"] == pytest.approx(15.0 * US)
    assert small["time_s"] == pytest.approx((15.0 + 32768 / (141e9 * 8 / 14) / US) * US)


def test_ncc_picks_the_protocol_by_size():
    picks = {s: plan("all_reduce", s, 8, H100)["protocol"] for s in (2**10, 2**20, 2**26)}
    assert picks == {2**10: "LL", 2**20: "LL", 2**26: "Simple"}
    # LL128 wins in between: 4 MiB: LL 15 + 4 MiB / (141 x 8/14) ; LL128 40.6 + ... ; Simple 56
    n, s = 8, 4 * MiB
    times = {"LL": 15.0 * US + s / (141e9 * n / 14), "LL128": 40.6 * US + s / (
        0.92 * 370e9 * n / 14), "Simple": 56.0 * US + s / (370e9 * n / 14)}
    assert plan("all_reduce", s, n, H100)["protocol"] == min(times, key=times.get)


def test_tree_in_one_node_is_a_chain_with_tree_latencies():
    n, nbytes = 8, 2**20
    p = plan("all_reduce", nbytes, n, H100, "tree", "LL")
    # baseLat 6.8 + 2 ((8/1 - 1) x 0.6 + log2(1) x 5.0)
    assert p["latency_s"] == pytest.approx((6.8 + 2 * 7 * 0.6) * US)
    # bus 0.92 B / 3.8, capped at 141 GB/s; x 1/2; NCCL's size correction log2(2^20 >> 6) = 14
    bw = min(0.92 * 370e9 / 3.8, 141e9) / 2 * 0.5
    assert p["bytes_s"] == pytest.approx(nbytes / bw)


def test_nvls_has_no_base_latency_and_a_size_dependent_bandwidth():
    n = 8
    for nbytes in (4 * MiB, 64 * MiB, 2**30):
        p = plan("all_reduce", nbytes, n, H100, "nvls")
        assert p["latency_s"] == pytest.approx(25 * US)
        peak_alg = 480e9 * n / (2 * (n - 1))
        assert p["bytes_s"] == pytest.approx(nbytes / (peak_alg * nbytes / (nbytes + 19.5e6)))
    # the bus bandwidth reached grows with the message: about 437 GB/s at 256 MiB
    busbw = [plan("all_reduce", s, n, H100, "nvls")["bus_bandwidth"] for s in
             (16 * MiB, 64 * MiB, 256 * MiB, 4 * 2**30)]
    assert busbw == sorted(busbw) and 430e9 < busbw[2] < 445e9 and busbw[-1] > 470e9
    # NCCL chooses it from 2 MiB (nccl-tests #309) by a fixed figure; tplab chooses by the
    # time it prices (ramp included), so "auto" is never slower than the ring: ring up to
    # 1 MiB, NVLS once its ramped time beats the ring's
    assert plan("all_reduce", MiB, n, H100, "auto")["algorithm"] == "ring"
    assert plan("all_reduce", 256 * MiB, n, H100, "auto")["algorithm"] == "nvls"
    with pytest.raises(ValueError, match="no such all_reduce"):
        plan("all_reduce", MiB, 8, A100, "nvls")          # A100 has no NVLink SHARP


def test_all_gather_and_reduce_scatter_rings_by_hand():
    n, nbytes = 8, 64 * MiB
    for op in ("all_gather", "reduce_scatter"):
        p = plan(op, nbytes, n, H100, "ring", "Simple")
        assert p["latency_s"] == pytest.approx((8.4 + (n - 1) * 3.4) * US)
        assert p["bytes_s"] == pytest.approx(nbytes * (n - 1) / n / 370e9)


# --- across nodes ------------------------------------------------------------------------

def test_ring_across_two_nodes_by_hand():
    n, nbytes = 16, 64 * MiB
    p = plan("all_reduce", nbytes, n, H100, "ring", "Simple")
    # nsteps 30, nInterSteps 2 x 2 nodes = 4 (2.21); intra steps at max(3.4, 3 x 1.0 Intel
    # net overhead), inter at 14.0; the plateau: x 1.4 (compute capability >= 80)
    assert p["latency_s"] == pytest.approx(1.4 * (8.4 + 26 * 3.4 + 4 * 14.0) * US)
    assert p["bytes_s"] == pytest.approx(nbytes / (min(450e9, 8 * 48e9) * n / 30))
    ll = plan("all_reduce", nbytes, n, H100, "ring", "LL")
    # LL between 2 Intel nodes: llMax 39 GB/s; steps 26 x max(0.6, 1.0) + 4 x 2.7
    assert ll["latency_s"] == pytest.approx((6.6 + 26 * 1.0 + 4 * 2.7) * US)
    assert ll["bytes_s"] == pytest.approx(nbytes / (39e9 * n / 30))
    # A100 nodes (AMD CPUs): net overhead 2 us, x 3 for Simple
    a = plan("all_reduce", nbytes, n, A100, "ring", "Simple")
    assert a["latency_s"] == pytest.approx(1.4 * (8.4 + 26 * 6.0 + 4 * 14.0) * US)


def test_tree_across_nodes_by_hand():
    n = 64                                          # 8 nodes of 8
    p = plan("all_reduce", 2**30, n, H100, "tree", "Simple")
    assert p["latency_s"] == pytest.approx((0 + 2 * (7 * 28 + 3 * 28)) * US)
    assert p["bytes_s"] == pytest.approx(2**30 / (0.92 * 384e9 / 2))   # size >= 2^28: no fix


def test_nvls_tree_across_nodes_by_hand():
    # NCCL 2.21.5 tuning.cc: no baseLat, 25 us NVLink + 2 log2(nodes) x 14 us network;
    # 5/6 x min(the node's in-switch rate, its NICs (halved past 2 nodes)), ramping like NVLS
    nvls_alg = 480e9 * 8 / 14                        # NVLS on 8 GPUs, as algorithm bandwidth
    for n, nics in ((16, 384e9), (32, 192e9), (64, 192e9)):
        p = plan("all_reduce", 2**32, n, H100, "nvls_tree")
        assert p["latency_s"] == pytest.approx((25 + 2 * math.log2(n // 8) * 14) * US)
        ramp = 2**32 / (2**32 + H100.intra.nvls_ramp)
        assert p["bytes_s"] == pytest.approx(2**32 / (5 / 6 * min(nvls_alg, nics) * ramp))
    # inside one node NCCL runs NVLS itself; NVLSTree needs NVLS (no A100)
    with pytest.raises(ValueError, match="no such all_reduce"):
        plan("all_reduce", 2**26, 8, H100, "nvls_tree")
    with pytest.raises(ValueError, match="no such all_reduce"):
        plan("all_reduce", 2**26, 16, A100, "nvls_tree")
    with pytest.raises(ValueError, match="plain alpha-beta"):
        plan("all_reduce", 2**26, 16, cost.LINKS["NVLink 4"], "nvls_tree")


def test_nvls_tree_is_chosen_on_two_nodes_at_large_sizes_as_nccl_1221_measured():
    # nccl#1221: enabling NVLS raised 2 nodes of 8 H100 to 430 GB/s bus bandwidth, and
    # changed nothing on more nodes (the ring stays faster there)
    two = plan("all_reduce", 4 * 2**30, 16, H100, "auto")
    assert two["algorithm"] == "nvls_tree"
    assert two["bus_bandwidth"] == pytest.approx(430e9, rel=0.05)
    assert two["bus_bandwidth"] > plan("all_reduce", 4 * 2**30, 16, H100, "ring")["bus_bandwidth"]
    for n in (32, 64, 256):
        assert plan("all_reduce", 4 * 2**30, n, H100, "auto")["algorithm"] != "nvls_tree"
    # and from tens of MB: below them its 53 us of latency and its ramp lose to ring / tree
    assert plan("all_reduce", 16 * MiB, 16, H100, "auto")["algorithm"] != "nvls_tree"
    assert plan("all_reduce", 64 * MiB, 16, H100, "auto")["algorithm"] == "nvls_tree"


def test_collnet_only_where_the_fabric_has_it():
    with pytest.raises(ValueError, match="no such all_reduce"):
        plan("all_reduce", 2**26, 16, H100, "collnet_direct")
    sharp = H100.with_(collnet=True)
    d = plan("all_reduce", 2**26, 16, sharp, "collnet_direct")
    # 2 (min(1, 7) x 3.7 + 7 x 0.4) + 31; bus 0.85 x B (Hopper), x 1/2
    assert d["latency_s"] == pytest.approx((2 * (3.7 + 7 * 0.4) + 31) * US)
    assert d["bytes_s"] == pytest.approx(2**26 / (0.85 * 370e9 / 2))
    c = plan("all_reduce", 2**26, 16, sharp, "collnet_chain")
    assert c["latency_s"] == pytest.approx((2 * 7 * 2.8 + 30) * US)


def test_cross_node_all_to_all_gets_one_nic_per_gpu():
    n, nbytes = 16, 64 * MiB
    p = plan("all_to_all", nbytes, n, H100)
    off_node = nbytes * 8 / 16 / 48e9                # half the data leaves the node, at 48
    assert p["bytes_s"] == pytest.approx(max(off_node, nbytes * 7 / 16 / 370e9))
    assert H100.link(16, "all_to_all").bandwidth == 48e9
    assert H100.link(16).bandwidth == 384e9          # the rings stripe 8 NICs: they bind


def test_latency_scales_every_protocol_with_the_link():
    slow = H100.with_(intra=H100.intra.with_(latency=2 * 3.4e-6, base_latency=2 * 8.4e-6))
    for protocol in ("LL", "LL128", "Simple"):
        assert plan("all_reduce", 2**20, 8, slow, "ring", protocol)["latency_s"] == \
            pytest.approx(2 * plan("all_reduce", 2**20, 8, H100, "ring", protocol)["latency_s"])


# --- heads, KV heads, Megatron's QKV gather ------------------------------------------------

def test_heads_decide_which_tp_degrees_exist():
    l8, l70 = cost.MODELS["Llama-3 8B"], cost.MODELS["Llama-3 70B"]
    assert cost.allowed_tps(l8) == (1, 2, 4, 8, 16, 32)          # 32 query heads
    assert cost.allowed_tps(l70) == (1, 2, 4, 8, 16, 32, 64)
    assert "32 query heads" in cost.tp_allowed(l8, 64)
    assert "KV heads" in cost.tp_allowed(BlockShape(hidden=96, heads=12, kv_heads=4), 6)
    with pytest.raises(ValueError, match="tp = 64"):
        cost.step_time(l8, 64, H100)
    with pytest.raises(ValueError, match="tp = 64"):
        cost.sweep(l8, H100, (8, 64))
    assert [r["tp"] for r in cost.sweep(l8, H100)] == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("name, share", [("Llama-3 8B", 0.375), ("Llama-3 70B", 0.3125)])
def test_kv_replication_adds_the_qkv_gather(name, share):
    shape = cost.MODELS[name]
    at8, at16 = cost.block_collectives(shape, 8), cost.block_collectives(shape, 16)
    extra = [r for r in at16 if r["role"] in ("qkv_gather", "qkv_scatter")]
    assert [r["op"] for r in extra] == ["all_gather", "reduce_scatter"] and len(at8) == 4
    kv_dim = 8 * 128
    assert all(r["bytes"] == shape.tokens * (shape.hidden + 2 * kv_dim) * 2 for r in extra)

    def wire(records, n):   # bytes each GPU sends: 2 (n-1)/n per all-reduce, (n-1)/n others
        return sum(r["bytes"] * (2 if r["op"] == "all_reduce" else 1) * (n - 1) / n
                   for r in records)
    assert wire(extra, 16) / wire(at8, 16) == pytest.approx(share)


# --- GEMM efficiency, MFU per row ----------------------------------------------------------

def test_gemm_efficiency_by_hand():
    # the one GEMM model (kernels.gemm_time): 4096 x 448 x 4096 on an H100 at its sustained
    # kernel rate, 698.6 TFLOP/s; 448 columns fill 448 / 512 of 128-wide tiles, k = 4096
    # fills the pipeline 4096 / (4096 + 128), and the call costs 6 us
    rate = 698.6e12
    m, n, k = 4096, 448, 4096
    compute = 2 * m * n * k / (rate * 448 / 512 * 4096 / (4096 + 128))
    assert cost.gemm_efficiency(m, n, k, H100) == pytest.approx(
        2 * m * n * k / rate / (6e-6 + compute))
    # a memory-bound GEMM: k = 64, the bytes it reads and writes over the 3.35 TB/s
    # datasheet x 0.896, what a copy reaches (hardware.HBM_EFFICIENCY)
    m, n, k = 4096, 4096, 64
    traffic = (2 * (m * k + k * n) + 2 * m * n) / (3.35e12 * 0.896)
    assert traffic > 2 * m * n * k / (rate * k / (k + 128))
    assert cost.gemm_efficiency(m, n, k, H100) == pytest.approx(
        2 * m * n * k / rate / (6e-6 + traffic))
    # and step_time's GEMMs at the preset's rate are kernels.gemm_time's
    shape = cost.MODELS["Llama-3 8B"].with_(layers=1, seq=4096, batch=1)
    times = cost.gemm_times(shape, 8, H100, mfu=H100.matmul_efficiency * H100.sustained)
    d_out = (4096 + 2 * 1024) // 8
    assert times["attention"]["col_fwd"] == pytest.approx(
        kernels.gemm_time(4096, d_out, 4096, H100))
    with pytest.raises(ValueError, match="m must be"):
        cost.gemm_efficiency(0, 1, 1, H100)


def test_rows_carry_their_mfu_and_it_falls_with_small_gemms():
    rows = cost.sweep(cost.MODELS["Llama-3 8B"], H100)
    mfus = [r["mfu"] for r in rows]
    assert 0.95 * 0.40 < mfus[0] < 0.40 and mfus == sorted(mfus, reverse=True)
    assert mfus[-1] < 0.3                            # TP 32: per-rank GEMMs 4096 x 448
    flat = cost.sweep(cost.MODELS["Llama-3 8B"], H100, gemm="flat")
    assert all(r["mfu"] == pytest.approx(0.40) for r in flat)


# --- data-parallel traffic -----------------------------------------------------------------

def test_dp_traffic_by_hand():
    shape = cost.MODELS["Llama-3 70B"]
    n = cost.param_count(shape, 8)
    recs = cost.dp_collectives(shape, 8, 64)
    assert recs == [{"op": "all_reduce", "bytes": 4 * n, "group_size": 64, "per": "step",
                     "what": "gradients"}]          # fp32 gradients (Megatron's bf16 recipe)
    z1 = cost.dp_collectives(shape, 8, 64, zero=1)
    assert [(r["op"], r["bytes"]) for r in z1] == [("reduce_scatter", 4 * n),
                                                    ("all_gather", 2 * n)]
    z3 = cost.dp_collectives(shape, 8, 64, zero=3, precision="mixed_bf16_grads")
    assert [(r["op"], r["bytes"], r["per"]) for r in z3] == [
        ("reduce_scatter", 2 * n, "micro_batch"), ("all_gather", 2 * n, "micro_batch"),
        ("all_gather", 2 * n, "micro_batch")]
    z2 = cost.dp_collectives(shape, 8, 64, zero=2)   # sharded gradients: every micro-batch
    assert [(r["op"], r["per"]) for r in z2] == [("reduce_scatter", "micro_batch"),
                                                  ("all_gather", "step")]
    per_mb = cost.dp_times(shape, 8, H100, dp=64, zero=2, micro_batches=16, overlap=False)
    once = cost.dp_times(shape, 8, H100, dp=64, zero=1, micro_batches=16, overlap=False)
    assert per_mb["dp_comm_s"] > 8 * once["dp_comm_s"] / 2
    # TP 8 fills the node: each DP group has 1 GPU per node and 1 NIC (48 GB/s)
    t = cost.dp_times(shape, 8, H100, dp=64, overlap=False)
    ring = cost.collective_time("all_reduce", 4 * n, 64, H100.with_(
        gpus_per_node=1, nics_per_node=1), "auto")
    assert t["dp_comm_s"] == pytest.approx(ring) == t["dp_exposed_s"]
    spread = cost.dp_times(shape, 8, H100, dp=64, micro_batches=16, overlap=False)
    assert spread["dp_comm_s"] == pytest.approx(ring / 16)
    hidden = cost.dp_times(shape, 8, H100, dp=64, overlap=True, backward_s=10.0)
    assert hidden["dp_exposed_s"] == 0 and hidden["dp_comm_s"] > 0


def test_every_row_has_dp_comm_and_it_enters_the_step():
    shape = cost.MODELS["Llama-3 8B"]
    alone = cost.step_time(shape, 8, H100)
    assert alone["dp_comm_s"] == 0 == alone["dp_exposed_s"]
    row = cost.step_time(shape, 8, H100, dp=64, dp_overlap=False)
    assert row["dp_comm_s"] > 0 and row["step_s"] == pytest.approx(
        row["compute_s"] + row["exposed_comm_s"] + row["dp_comm_s"])


def test_memory_in_real_bytes_with_a_reserve():
    assert H100.memory == 81559 * 2**20 and cost.HARDWARE["H200 SXM"].memory == 143771 * 2**20
    assert H100.usable_memory == H100.memory - 2 * 2**30
    roomy = H100.with_(memory_reserve=0)
    row = cost.step_time(cost.MODELS["Llama-3 8B"], 2, roomy, True, dp=8, zero=1)
    assert row["fits"] == (row["memory_bytes"] <= roomy.memory)
    with pytest.raises(ValueError, match="memory_reserve"):
        H100.with_(memory_reserve=-1)


def test_fused_norm_saves_2h_plus_4_bytes_a_token():
    shape = cost.MODELS["Llama-3 70B"]
    comp, fused = (cost.gpu_memory(shape, 4, True, norm=nm)["activation_bytes"]
                   for nm in ("composite", "fused"))
    # two norms per layer, (8h + 4) - (2h + 4) = 6h bytes a token each, 1/4 of the tokens
    assert comp - fused == pytest.approx(80 * 2 * 6 * 8192 * 4096 / 4)
    assert 7.5e9 < comp - fused < 8.5e9


def test_fused_swiglu_saves_6f_bytes_a_token():
    shape = cost.MODELS["Llama-3 70B"]
    comp, fused = (cost.gpu_memory(shape, 4, True, swiglu=sw)["activation_bytes"]
                   for sw in ("composite", "fused"))
    # tplab's eager SwiGLU keeps 4 f-sized bf16 tensors (8f bytes a token), Megatron's fused
    # one its input [w1 x, w3 x] and w2's input (6f): 2f = 57344 bytes a token, split 4 ways
    assert comp - fused == 80 * 2 * 28672 * 4096 / 4
    saved = cost.layer_saved(shape, swiglu="fused")
    assert sum(i.per_token * i.element_bytes for i in saved if "swiglu" in i.what) == 6 * 28672
    plain = cost.BlockShape(hidden=8, heads=2, ffn=32, seq=4)          # no gate: no SwiGLU
    assert cost.activation_bytes(plain, swiglu="fused") == cost.activation_bytes(plain)
    with pytest.raises(ValueError, match="swiglu"):
        cost.gpu_memory(shape, 4, swiglu="eager")


def test_block_saves_name_tplabs_block_and_megatrons():
    shape = cost.MODELS["Llama-3 70B"]
    h, f, t, s, layers = 8192, 28672, 4, 4096, 80
    tplab_, megatron = (cost.gpu_memory(shape, t, True, **cost.BLOCK_SAVES[k])
                        ["activation_bytes"] for k in ("tplab", "megatron"))
    assert tplab_ == cost.gpu_memory(shape, t, True)["activation_bytes"]   # the defaults
    # per token: two norms 6h/t less, the two linear inputs 4h (t-1)/t less, SwiGLU 2f/t less
    per_token = 2 * 6 * h / t + 2 * 2 * h * (t - 1) / t + 2 * f / t
    assert tplab_ - megatron == pytest.approx(layers * s * per_token)
    assert 20.5e9 < tplab_ - megatron < 21e9                   # about 20.8 GB per GPU
    row = cost.step_time(shape.with_(layers=1), t, H100, True, **cost.BLOCK_SAVES["megatron"])
    assert (row["norm"], row["swiglu"]) == ("fused", "fused")


def test_all_gather_is_a_ring_only_and_says_so():
    # NCCL 2.21.5 runs NVLS all-gathers inside a node (enqueue.cc); tplab does not model them
    with pytest.raises(ValueError, match="ring only.*NVLS"):
        cost.collective_time("all_gather", 2**26, 8, H100, algorithm="nvls")
    ring, auto = (cost.collective_plan("all_reduce", 2**26, 8, H100, algorithm=a)
                  for a in ("ring", "auto"))
    assert (ring["algorithm"], auto["algorithm"]) == ("ring", "nvls")   # NCCL_ALGO=Ring or not
