"""cost.TrainingRun / cost.predict against published runs, the rules a run must obey, the
pipeline terms, and the NCCL findings of the third review (nccl#1455, auto vs ring)."""

import dataclasses
import statistics

import pytest

from tplab import cost
from tplab.cost import (
    data_parallel,
    kernels,
    nccl,
    pipeline,
    published,
    scores,
    training_run,
)

MiB = 2**20
H100 = cost.HARDWARE["H100 SXM"]


@pytest.mark.parametrize("kwargs, rule", [
    (dict(gpus=12, tp=8), "tp x pp x cp x dp"),
    (dict(gpus=24, tp=3), "query heads"),
    (dict(gpus=64, tp=8, pp=8, vpp=3), "layers per stage"),
    (dict(gpus=16, tp=8, global_batch=3), "micro_batch x dp"),
    (dict(gpus=64, tp=8, pp=4, vpp=2, global_batch=6), "multiple of pp"),
    (dict(gpus=16, tp=8, cp=2, seq_len=4098), "2 x cp"),
    (dict(gpus=8, pp=1, vpp=2), "needs pp > 1"),
    (dict(gpus=8, ep=2), "ep must be 1"),
])
def test_an_invalid_run_names_its_rule(kwargs, rule):
    kwargs.setdefault("global_batch", 64)
    with pytest.raises(ValueError, match=rule):
        cost.TrainingRun("Llama-3 70B", "H100 SXM", **kwargs)


def test_unknown_names_and_fp8_without_tensor_cores_are_refused():
    with pytest.raises(ValueError, match="not in cost.MODELS"):
        cost.TrainingRun("Llama-9 1T", "H100 SXM", 8)
    with pytest.raises(ValueError, match="not in cost.HARDWARE"):
        cost.TrainingRun("Llama-3 8B", "TPU", 8)
    with pytest.raises(ValueError, match="fp8"):
        cost.TrainingRun("Llama-3 8B", "A100 SXM", 8, precision="fp8")


@pytest.fixture(scope="module")
def scored():
    return scores.score()


def test_every_row_of_every_table_is_data_naming_its_source_commit_file_and_stack():
    rows = published.RUNS
    assert len(rows) >= 309 and len({r["source"] for r in rows}) == 8
    # a row TrainingRun cannot express stays in the data, counted, for a rule that reads it
    assert len(published.ROWS) == len(rows) + len(published.UNSCORED)
    assert all(why.split(" ")[0] in ("model", "system", "precision")
               for _, why in published.UNSCORED)
    bridge = [r for r in published.ROWS if r["source"] == published.BRIDGE]
    # every container of performance-summary-archive.md that prints a precision (25.09 does
    # not): 233 rows, the 24 dense Llama rows on H100, B200 and GB200 scored
    assert len(bridge) == 233 and sum(r["source"] == published.BRIDGE for r in rows) == 24
    for r in rows:
        assert r["commit"] and r["file"] and r["printed"] and r["measured"] > 0
        assert r["stack"] in cost.STACKS
    # llm-foundry's H100 80GB BF16 (Large Scale 18, and 52), H100 80GB FP8 (7) and A100
    # 80GB (61) tables whole, each row's line in the README kept; torchtitan's 405B rows
    # on 128 H100s; every printed peak
    foundry = [r for r in rows if r["source"] == published.FOUNDRY]
    assert len(foundry) == 138 and len({r["line"] for r in foundry}) == 138
    assert sum(r["hardware"] == "H100 SXM" for r in foundry) == 18 + 52 + 7
    assert sum(r["precision"] == "fp8" for r in foundry) == 7
    assert sum(r["sharding"] == "zero2" for r in foundry) == 6     # SHARD_GRAD_OP
    assert sum(r["source"] == published.TITAN and "405B" in r["where"] for r in rows) == 3
    assert sum(r["peak_gib"] is not None for r in rows) == 18 + 1     # + dgxc's 8B log
    # dgxc-benchmarking: every measured table of v25.04.01 (H100: Llama 3.1 8B, 70B, 405B
    # and its proxies, GPT-3 175B, Nemotron-4 15B and 340B, BF16 and FP8), of v25.03's
    # llama3.1 READMEs (H100, settings in each table's title) and of v25.05 (GB200 405B),
    # each row's launch settings from the same file; the step time and the batch agree with
    # the throughput printed beside them
    dgxc = [r for r in published.ROWS if r["source"] == published.DGXC]
    assert len(dgxc) == 34 + 10 + 24 + 34 + 34 + 6                  # + v25.01 (NeMo 24.09)
    assert sum(r["source"] == published.DGXC for r in rows) == 34 + 10 + 34 + 34 + 6  # no Nemotron
    assert sum(r["release"] == "v25.03" and r["pp"] == 9 and r["vpp"] == 7 for r in dgxc) == 6
    assert sum(r["hardware"] == "GB200 NVL72" for r in dgxc) == 6
    assert all(len(r["commit"]) == 40 and r["container"].startswith("nvcr.io") for r in dgxc)
    for r in dgxc:
        assert r["measured"] * r["gpus"] == pytest.approx(r["printed_tokens_per_s"], rel=1e-3)


def test_the_exclusion_rule_reads_the_row_itself():
    out = published.compare()
    left_out = [r for r in out["rows"] if r["excluded"]]
    assert all(r["stack"] == "deepspeed-2021" or "AsyncTP" in r["where"]
               or "Async TP" in r["where"] or "bf16 PURE" in r["printed"] for r in left_out)
    assert sum(r["stack"] == "deepspeed-2021" for r in left_out) == 6
    # llm-foundry's pure-bf16 states (the rule that left its A100 40GB table out): the two
    # A100 80GB rows that print "bf16 PURE"
    pure = [r for r in left_out if "bf16 PURE" in r["printed"]]
    assert [(r["model"], r["gpus"]) for r in pure] == [("MPT 70B", 64), ("MPT 70B", 32)]
    assert out["goal_rows"] == len(out["rows"]) - len(left_out)
    errors = [abs(r["error"]) for r in out["rows"]]
    assert out["median_all"] == pytest.approx(statistics.median(errors))
    # the six ZeRO-3 rows, checked on the rows themselves: at a (near-)fixed global batch,
    # 3.5-4 times the GPUs barely shortens the measured step where the work falls four-fold
    zero3 = [r for r in left_out if r["stack"] == "deepspeed-2021"]
    for rows in (zero3[:3], zero3[3:]):
        steps = [published.step_seconds(r) for r in rows]
        work = [r["global_batch"] / r["gpus"] for r in rows]   # sequences per GPU
        assert work[-1] <= work[0] / 4 and steps[-1] > 0.6 * steps[0]
    assert all(r["error"] > 0.5 for r in zero3)


def test_a_run_names_its_stack_and_an_unknown_stack_lists_the_names():
    run = dict(model="Llama-3 8B", hardware="H100 SXM", gpus=8, seq_len=8192)
    assert cost.predict(cost.TrainingRun(**run)).stack == cost.DEFAULT_STACK == "megatron-lm"
    with pytest.raises(ValueError, match="torchtitan.*llm-foundry-2023"):
        cost.TrainingRun(**run, stack="nemo-2019")
    with pytest.raises(ValueError, match="stack = 3: expected a cost.STACKS name"):
        cost.TrainingRun(**run, stack=3)
    with pytest.raises(ValueError, match="attention_scale"):
        cost.Stack("mine", attention_scale=2.0)
    with pytest.raises(ValueError, match="not in cost.STACKS"):
        cost.layouts("Llama-3 8B", "H100 SXM", 8, 8, stack="nemo-2019")
    assert all(isinstance(s, cost.Stack) for s in cost.STACKS.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.STACKS["torchtitan"].kernels = "fused"
    assert not hasattr(published, "FRAMEWORK")
    titan = cost.predict(cost.TrainingRun(**run, stack="torchtitan"))
    assert titan.stack == "torchtitan" and titan.run.kernels == "eager" and titan.run.torch_cp
    # the same layout answered for two stacks differs, and an override is the stack's field
    assert titan.step_s > cost.predict(cost.TrainingRun(**run, stack="megatron-bridge")).step_s
    compiled = cost.TrainingRun(**run, stack="torchtitan", kernels="fused").settings
    assert dataclasses.replace(compiled, name="x", cites="") == dataclasses.replace(
        cost.STACKS["torchtitan+compile"], name="x", cites="")


def test_composer_fsdp_syncs_every_micro_batch_as_its_sibling_sweep_measures():
    # llm-foundry #543's larger_mb.md (data/siblings, not scored): 7B on 8 A100s at
    # micro-batch 1, 2, 4, 6. GPU-seconds per token = a + c / (micro-batch tokens): c is
    # what one micro-batch costs whatever its size; the model's FSDP traffic of one
    # micro-batch, all of it exposed under the llm-foundry-2023 stack, is that c
    rows = [r for r in published.load(published.DATA / "siblings" / "llm_foundry_larger_mb.json")
            if r["model"] == "MPT 7B"]
    assert sorted(r["micro_batch"] for r in rows) == [1, 2, 4, 6]
    x = [1 / (r["micro_batch"] * r["seq_len"]) for r in rows]
    y = [1 / r["measured"] / 8 * 8 for r in rows]                 # GPU-seconds per token
    c = statistics.linear_regression(x, y).slope
    assert c == pytest.approx(0.208, rel=0.02)
    run = cost.TrainingRun("MPT 7B", "A100 SXM", 8, micro_batch=1, global_batch=16,
                           seq_len=2048, sharding="fsdp", stack="llm-foundry-2023")
    p = cost.predict(run)
    per_mb = p.breakdown["dp_comm_s"] / run.micro_batches
    assert per_mb == pytest.approx(c, rel=0.05)
    assert p.breakdown["dp_exposed_s"] == pytest.approx(p.breakdown["dp_comm_s"])
    for r in rows:                                   # and each sibling row within 3%
        q = cost.predict(cost.TrainingRun("MPT 7B", "A100 SXM", 8, micro_batch=r["micro_batch"],
                                          global_batch=r["global_batch"], seq_len=2048,
                                          sharding="fsdp", stack="llm-foundry-2023"))
        assert q.tokens_per_s_per_gpu == pytest.approx(r["measured"], rel=0.03)


def test_llm_foundrys_triton_attention_runs_at_the_fa1_class_rate():
    # flash_attn_triton.py is FA1's Triton kernel; FA2's abstract: FA1 25-40% of peak
    shape = cost.MODELS["MPT 7B"].with_(seq=8192, batch=1)
    a100 = cost.HARDWARE["A100 SXM"]
    run = cost.TrainingRun("MPT 7B", "A100 SXM", 8, seq_len=8192, stack="llm-foundry-2023")
    lt = training_run.layer_times(run)
    rate = 2 * 8192**2 * 4096 / lt.attention_s / a100.flops
    assert 0.25 <= rate / a100.sustained <= 0.40
    assert lt.attention_s > kernels.attention_time(shape, 1, 1, a100)


def test_flash_backward_is_five_matmuls_to_the_forwards_two():
    shape = cost.MODELS["Llama-3 8B"].with_(seq=8192, batch=1)
    fwd = kernels.attention_time(shape, 1, 1, H100)
    # causal forward: half of 4 b s^2 h FLOPs at the flash rate; backward 2.5 x that
    assert fwd == pytest.approx(2 * 8192**2 * 4096 / (
        H100.flops * H100.attention_efficiency * H100.sustained))
    assert kernels.attention_backward(shape, 1, 1, H100) == pytest.approx(2.5 * fwd)


def test_unfused_attention_runs_q_k_transposed_at_the_short_k_gemm_rate():
    shape = cost.BlockShape(hidden=6144, heads=48, layers=1, seq=2048, batch=4)
    a100 = cost.HARDWARE["A100 SXM"]
    t = kernels.attention_time(shape, 1, 8, a100, "unfused")
    # 4 x 6 heads of (2048 x 128) @ (128 x 2048): k = 128 fills the pipeline half-way
    qk = 2 * 2048 * 2048 * 128 * 24 / (a100.flops * a100.matmul_efficiency * a100.sustained
                                       * 128 / 256)
    flat = 4 * 4 * 2048**2 * 6144 / 8 / (a100.flops * a100.matmul_efficiency)
    assert t > qk > flat / 2
    assert kernels.attention_backward(shape, 1, 8, a100, "unfused") > t


def test_fp8_quantises_each_linears_operands_and_hopper_writes_them_transposed_too():
    h, f, t = 1024, 4096, 2048
    shape = cost.BlockShape(hidden=h, heads=8, layers=1, seq=t, batch=1, ffn=f)
    assert not shape.gated and shape.kv_dim == h
    # inputs of qkv, wo, fc1 (h wide) and fc2 (f wide) and the four weights; backward the
    # gradients of their outputs (3h, h, f, h wide)
    fwd = t * (3 * h + f) + 3 * h * h + h * h + 2 * h * f
    bwd = t * (3 * h + h + f + h)
    hopper = kernels.fp8_cast_bytes(shape, t, 1, H100)
    blackwell = kernels.fp8_cast_bytes(shape, t, 1, cost.HARDWARE["B200"])
    assert hopper == pytest.approx((6 * fwd, 6 * bwd))
    assert blackwell == pytest.approx((5 * fwd, 5 * bwd))
    run = dict(model="Llama-3 8B", hardware="H100 SXM", gpus=8, seq_len=8192)
    fp8 = cost.predict(cost.TrainingRun(**run, precision="fp8"))
    bf16 = cost.predict(cost.TrainingRun(**run))
    assert bf16.step_s > fp8.step_s > bf16.step_s / 2


def test_deepspeed_2021_per_parameter_collectives_do_not_explain_its_zero3_steps():
    # DEEPSPEED_ZERO3_2021: one call per parameter (4 weights gathered twice, 12 gradients
    # reduce-scattered a layer), priced by the model's own NCCL latency and bandwidth
    zero3 = [r for r in published.RUNS if r["stack"] == "deepspeed-2021"]
    assert len(zero3) == 6
    for r in zero3:
        calls = published.zero3_per_parameter_s(r)
        assert calls["calls"] == r["shape"].layers * (2 * 4 + 12)
        model = cost.predict(published.to_run(r)).step_s
        excess = published.step_seconds(r) - model
        # its latency is a small part of what the run spent beyond the model's step, and
        # even with every call exposed (none behind the compute) the row stays out of goal
        assert calls["latency_s"] < 0.2 * excess
        assert published.step_seconds(r) / (model + calls["total_s"]) - 1 > 0.25
    # from 384 to 1536 GPUs (175B) the ring's (N - 1) steps quadruple the latency, but the
    # measured excess grows by more than three times what that adds
    low, high = zero3[0], zero3[2]
    lat = [published.zero3_per_parameter_s(r)["latency_s"] for r in (low, high)]
    extra = [published.step_seconds(r) - cost.predict(published.to_run(r)).step_s
             for r in (low, high)]
    assert lat[1] > 3.5 * lat[0] and extra[1] - extra[0] > 3 * (lat[1] - lat[0])


def short(figure: str):
    """A goal of issue 35 not met yet: a strict xfail naming the figure measured when it
    was written (benchmarks/published_runs.py prints it now); the assert in the test
    prints the live one, and the day the goal holds the test fails loudly (XPASS)."""
    return pytest.mark.xfail(strict=True, reason=f"issue 35 goal not met: {figure}")


@pytest.mark.parametrize("way", ["all", "goal"])
def test_goal_median_and_p90_over_every_scored_row(scored, way):
    e = scored[way]
    assert e["rows"] >= 200
    assert e["median"] <= 0.08 and e["p90"] <= 0.20, (e["median"], e["p90"])


@pytest.mark.parametrize("way", [
    pytest.param("all", marks=short("sources past +-8%: Llama 3 -11.2%, Narayanan +10.9% "
                                    "(torchtitan's H100 tables +7.99%)")),
    pytest.param("goal", marks=short("goal set: Llama 3 -11.2%, Narayanan +9.8%, "
                                     "torchtitan's H100 tables +8.7%"))])
def test_goal_each_sources_signed_median_within_8_percent(scored, way):
    off = {s[:30]: f"{m:+.1%}" for s, m in scored[way]["signed"].items() if abs(m) > 0.08}
    assert not off, off


def test_goal_at_least_200_rows_scored(scored):
    # llm-foundry's Large Scale and FP8 tables, dgxc's 118, Megatron-Bridge's 24: 343 scored,
    # 329 in the goal set
    assert scored["all"]["rows"] >= 200 and scored["goal"]["rows"] >= 200


def test_goal_same_source_pairs_ordered(scored):
    good, total = scored["pairs_all"]
    assert total > 5000 and good / total >= 0.95


@short("held out: Llama 3 14.5% (<= 12%); every other source 2.1-6.4%")
def test_goal_leave_one_source_out(scored):
    loso = scored["loso_goal"]
    assert all(0.85 < v["factor"] < 1.0 for v in loso.values())   # one bias, one sign
    off = {s[:30]: f"{v['after']:.1%}" for s, v in loso.items() if v["after"] > 0.12}
    assert not off, off


@short("mean |error| 4.38% (Calculon 3.65%), max 7.89%, no per-run setting")
def test_goal_korthikantis_eight_runs(scored):
    k = scored["korthikanti"]
    assert k["runs"] == 8
    assert k["mean"] <= 0.0365, k


@short("14 of 19 printed peaks within 10% (allocator-reserved bytes), worst -27%: "
       "Table 5's 1F1B and Table 6's 4D rows under-counted (-27%, -20% to -23%; each "
       "rank through torch's schedule, fp8-gathered weights kept), Table 5's interleaved "
       "-4% (Table 4's TP rows -7%, -1%)")
def test_goal_memory_within_10_percent_of_every_printed_peak(scored):
    m = scored["memory"]
    assert len(m["rows"]) == 18 + 1                   # torchtitan's and dgxc's 8B log
    assert m["within_10"] == 19, (m["within_10"], m["worst"])


@short("2 published runs the model says do not fit: llm-foundry's 3B at 8192 on H100 "
       "(79.7 GiB of 79.6, decided by the headroom assumption) and Llama 3's 8K-GPU row "
       "(93.8 GiB at V 4, no recomputation as its section 3.3.2 says; its own schedule "
       "is not modelled)")
def test_goal_every_published_run_fits(scored):
    assert not scored["memory"]["not_fitting"], len(scored["memory"]["not_fitting"])


@short("3 rows over 25% without a named cause: dgxc's three GB200 405B FP8 rows (+29% to "
       "+32%; their BF16 twins +10% to +13%)")
def test_goal_every_row_over_25_percent_has_a_named_cause(scored):
    unexplained = [r["where"] for r, why in scored["over"] if why == "unexplained"]
    assert not unexplained, len(unexplained)


def test_llm_foundry_ran_h100_at_an_a100_like_ratio_on_one_stack():
    # FOUNDRY_STACK: the same configurations on both GPUs, measured 1.8-2.6 x apart (but the
    # one row its own table contradicts, published.foundry_disagreeing), where the presets'
    # sustained GEMM rates are 2.85 x apart and the model gives a median 8% more a pair
    # (3.1 x and 16% with the later node MSMF's 755 on Hopper)
    pairs = published.foundry_pairs(published.RUNS)
    assert len(pairs) == 39
    odd = {r["where"] for r in published.foundry_disagreeing(published.RUNS)}
    measured = [h["measured"] / a["measured"] for h, a in pairs if a["where"] not in odd]
    assert all(1.8 <= r <= 2.7 for r in measured)

    def gemm(hw):
        return hw.flops * hw.matmul_efficiency * hw.sustained

    preset = gemm(H100) / gemm(cost.HARDWARE["A100 SXM"])
    assert preset > 2.8 > 2.7 >= max(measured)
    over = [cost.predict(published.to_run(h)).tokens_per_s_per_gpu
            / cost.predict(published.to_run(a)).tokens_per_s_per_gpu
            / (h["measured"] / a["measured"]) - 1 for h, a in pairs]
    assert 0.04 < statistics.median(over) < 0.15


def test_torch_context_parallel_moves_every_query_head_and_fp32_gradients():
    # torchtitan's CP: repeat_kv before SDPA (K, V with all 128 query heads of 405B, 16 a TP
    # rank), all-gathered (forward, recomputed forward, backward); dK, dV sent in fp32
    run = cost.TrainingRun("Llama-3.1 405B", "H100 96GB (500 W)", 512, tp=8, pp=8, cp=8,
                           global_batch=8, seq_len=262144, recompute="full", torch_cp=True)
    view = data_parallel.dp_group_hardware(run.hw, 8)
    kv = 2 * 262144 * 16 * 128 * 2                        # K and V, every head, bf16
    ag = cost.collective_time("all_gather", kv, 8, view, "auto")
    send = cost.collective_time("send", 2 * kv / 8, 2, view, "auto")
    exposed = training_run.cp_exposed(run, 0.0, 0.0)  # nothing to hide behind
    assert exposed == pytest.approx(3 * ag + 8 * send)
    gqa = training_run.cp_exposed(dataclasses.replace(run, torch_cp=False), 0.0, 0.0)
    assert exposed > 16 * gqa / 2                         # 16 query heads to 1 KV head a rank


def test_torchtitans_cp_rows_raise_their_marginal_cost_past_cp_2_where_the_model_does_not():
    # torchtitan's Table 2 (8 H100s, CP inside one node): every rank holds 32,768 tokens at
    # every CP degree, so a token's time is a + b x (sequence). The measured b from CP 1 to
    # 2 is near the model's (4.2e-9 s measured, 5.2e-9 priced since round fourteen's FA2
    # rate and held clock); from CP 2 to 4 and 4 to 8 it is 1.6-2 times the measured CP 1-2
    # step, where the model's stays put (docs/VALIDATION.md): the CP 4 and 8 rows' error is
    # that step, not a constant
    rows = sorted((r for r in published.RUNS if r["source"] == published.TITAN_H100
                   and r["where"].startswith("Table 2")), key=lambda r: r["cp"])
    assert [r["cp"] for r in rows] == [1, 2, 4, 8]
    model = [cost.predict(published.to_run(r)).tokens_per_s_per_gpu for r in rows]

    def slopes(rate):
        return [(1 / rate[i + 1] - 1 / rate[i]) / (rows[i + 1]["seq_len"] - rows[i]["seq_len"])
                for i in range(3)]

    measured, priced = slopes([r["measured"] for r in rows]), slopes(model)
    assert measured[0] == pytest.approx(priced[0], rel=0.3)
    assert min(measured[1:]) > 1.6 * measured[0] and min(measured[1:]) > 1.25 * priced[0]
    assert max(priced) < 1.05 * min(priced)


def test_the_bubble_is_p_minus_1_over_v_m_of_the_step():
    base = dict(gpus=64, tp=8, pp=8, global_batch=64, seq_len=2048, recompute="selective")
    for vpp in (1, 3):
        p = cost.predict(cost.TrainingRun("GPT 175B", "A100 SXM", vpp=vpp, **base))
        m = p.run.micro_batches
        layer = p.breakdown["compute_s"] / m     # the slowest stage's micro-batch, no comm
        stage = layer + (p.breakdown["tp_exposed_s"] + p.breakdown["cp_exposed_s"]) / m
        assert p.breakdown["pp_bubble_s"] == pytest.approx(7 / vpp * stage)
        assert p.breakdown["pp_bubble_s"] / (m * stage) == pytest.approx(7 / (vpp * m))


def test_mfu_is_end_to_end_and_below_the_compute_only_rate():
    p = cost.predict(cost.TrainingRun("Llama-3 70B", "H100 SXM", 1024, tp=8, pp=4, vpp=5,
                                      global_batch=512, seq_len=8192))
    flops = cost.training_run.model_flops_per_token(p.run.shape) * 512 * 8192
    assert p.mfu == pytest.approx(flops / (p.step_s * 1024 * H100.flops))
    assert p.step_s > p.breakdown["compute_s"]
    assert p.tokens_per_s_per_gpu == pytest.approx(512 * 8192 / (p.step_s * 1024))


def test_tp_stays_inside_the_nvlink_domain_at_equal_memory():
    # Llama-3 70B on H100: TP 16 spans two nodes; TP 8 x PP 2 holds the same 1/16 of the
    # weights per GPU and keeps TP on NVLink. Every published 70B+ run does the latter.
    kw = dict(global_batch=256, seq_len=8192, recompute="selective")
    tp16 = cost.predict(cost.TrainingRun("Llama-3 70B", "H100 SXM", 256, tp=16, **kw))
    pp2 = cost.predict(cost.TrainingRun("Llama-3 70B", "H100 SXM", 256, tp=8, pp=2, **kw))
    assert tp16.memory["param_bytes"] == pytest.approx(pp2.memory["param_bytes"], rel=0.02)
    assert pp2.tokens_per_s_per_gpu > tp16.tokens_per_s_per_gpu
    assert tp16.breakdown["tp_exposed_s"] > 2 * pp2.breakdown["tp_exposed_s"]


def test_zero2_and_fsdp_reduce_scatter_every_micro_batch():
    kw = dict(gpus=64, global_batch=64 * 8, seq_len=4096)
    comm = {s: cost.predict(cost.TrainingRun("Llama-3 8B", "H100 SXM", sharding=s, **kw)
                            ).breakdown["dp_comm_s"] for s in ("zero1", "zero2")}
    # 8 micro-batches: zero2 pays 8 reduce-scatters where zero1 pays one
    assert comm["zero2"] > 4 * comm["zero1"]


def test_without_overlap_the_gradient_collectives_are_all_exposed():
    kw = dict(gpus=64, tp=8, global_batch=64, seq_len=2048)
    for sharding in ("ddp", "zero1"):
        behind = cost.predict(cost.TrainingRun("GPT 22B", "A100 SXM", sharding=sharding, **kw))
        after = cost.predict(cost.TrainingRun("GPT 22B", "A100 SXM", sharding=sharding,
                                              grad_overlap=False, **kw))
        assert after.breakdown["dp_exposed_s"] == pytest.approx(after.breakdown["dp_comm_s"])
        assert behind.breakdown["dp_exposed_s"] < after.breakdown["dp_exposed_s"]
        assert after.step_s > behind.step_s
    # Megatron-LM of 2021-2022 (cost.STACKS): reduced after the last backward
    assert not cost.STACKS["megatron-lm-2021"].grad_overlap
    # and, before September 2021, the TP backward all-reduce waited too
    sync = cost.predict(cost.TrainingRun("GPT 22B", "A100 SXM", tp_overlap=False, **kw))
    overlapped = cost.predict(cost.TrainingRun("GPT 22B", "A100 SXM", **kw))
    assert sync.breakdown["tp_exposed_s"] > overlapped.breakdown["tp_exposed_s"]
    assert not cost.STACKS["megatron-lm-2021"].tp_overlap
    # and in 2022 the async collectives were ordered before their GEMM by a no-op kernel
    # only ("Remove noop used to try to force scheduling", bdd97312, 2022-10-14: "ordering
    # isn't imposed by the scheduler"): not assured, so not counted hidden
    assert not cost.STACKS["megatron-lm-2022"].tp_overlap
    assert "bdd97312" in cost.STACKS["megatron-lm-2022"].cites
    assert cost.STACKS["megatron-lm"].tp_overlap
    with pytest.raises(TypeError, match="grad_overlap"):
        cost.TrainingRun("GPT 22B", "A100 SXM", 8, grad_overlap="no")


def test_without_p2p_overlap_the_interleaved_schedule_waits_on_every_exchange():
    # Korthikanti's 175B: PP 8 x 3 virtual stages, 64 micro-batches, Megatron-LM of 2022
    kw = dict(gpus=64, tp=8, pp=8, vpp=3, global_batch=64, seq_len=2048,
              recompute="selective")
    waits = cost.predict(cost.TrainingRun("GPT 175B", "A100 SXM", p2p_overlap=False, **kw))
    hides = cost.predict(cost.TrainingRun("GPT 175B", "A100 SXM", **kw))
    one = pipeline.p2p_time(waits.run.shape, 8, 1, waits.run.hw)
    assert hides.breakdown["pp_p2p_s"] == pytest.approx(2 * 7 * one)   # fill and drain
    assert waits.breakdown["pp_p2p_s"] >= 64 * 3 * one    # at least one per forward chunk
    assert waits.step_s > hides.step_s
    assert not cost.STACKS["megatron-lm-2022"].p2p_overlap
    assert cost.STACKS["megatron-bridge"].p2p_overlap


def test_best_layout_fits_and_beats_every_other_fitting_layout():
    grid = dict(tps=(1, 2, 4, 8), pps=(1, 2, 4), cps=(1,), vpps=(1,), micro_batches=(1,),
                shardings=("zero1", "fsdp"), recomputes=("selective", "full"))
    best = cost.best_layout("Llama-3 70B", "H100 SXM", 256, 256, seq_len=4096, **grid)
    everything = cost.layouts("Llama-3 70B", "H100 SXM", 256, 256, seq_len=4096, **grid)
    assert best.fits and best.run.tp <= 8
    assert all(best.tokens_per_s_per_gpu >= p.tokens_per_s_per_gpu
               for p in everything if p.fits)


def test_nvls_bandwidth_follows_the_group_size_of_nccl_1455():
    measured = {2: 367, 3: 367, 4: 367, 5: 420, 6: 440, 7: 460, 8: 480}   # GB/s, nccl#1455
    for n, busbw in measured.items():
        g = nccl.Group(n, H100, "all_reduce")
        assert nccl.bus_bandwidth("nvls", "Simple", g) == pytest.approx(busbw * 1e9)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_auto_is_never_slower_than_the_ring_it_priced(n):
    for nbytes in [2**k for k in range(10, 33, 2)] + [1.25 * MiB, 40 * MiB]:
        auto = cost.collective_time("all_reduce", nbytes, n, H100, "auto")
        for algorithm in ("ring", "tree") + (("nvls",) if n <= 8 else ("nvls_tree",)):
            assert auto <= cost.collective_time("all_reduce", nbytes, n, H100, algorithm
                                                ) * (1 + 1e-12), (n, nbytes, algorithm)


def test_the_500_w_h100_holds_the_nvl_end_of_torchtitans_bracket():
    capped, sxm = cost.HARDWARE["H100 96GB (500 W)"], H100
    assert capped.flops == sxm.flops          # torchtitan's MFU divides by the SXM's peak
    # its Tensor Cores at the H100 NVL's dense bf16 peak (835 of 989), at the power cap
    rate = capped.flops * capped.matmul_efficiency * capped.sustained
    assert rate == pytest.approx(835e12 * sxm.matmul_efficiency * sxm.sustained)
    assert rate / (sxm.flops * sxm.matmul_efficiency * sxm.sustained) == pytest.approx(
        835 / 989)


def test_the_gemm_kernel_rate_against_xla_s_measured_h100_table():
    errors, large = [], []
    for m, n, k, tflops in kernels.GEMM_POINTS:
        measured = 2 * m * n * k / (tflops * 1e12)
        e = abs(kernels.gemm_time(m, n, k, H100, sustained=False) / measured - 1)
        errors.append(e)
        if min(m, n) >= 1024:
            large.append(e)
    assert len(errors) == 27 and len(large) == 9
    assert statistics.median(errors) < 0.06 and max(errors) < 0.35
    assert statistics.median(large) < 0.05 and max(large) < 0.08
    # one roofline: a large GEMM runs at the measured kernel rate, not at an MFU
    t = kernels.gemm_time(8192, 8192, 8192, H100, sustained=False)
    assert 2 * 8192**3 / t / H100.flops == pytest.approx(
        H100.matmul_efficiency * 8192 / (8192 + kernels.GEMM_K0), rel=0.01)
    # in a run, at the power cap: H200's published MSMF with all 8 GPUs computing, 698.6
    # TFLOP/s (same die, same 700 W)
    held = 2 * 8192**3 / kernels.gemm_time(8192, 8192, 8192, H100)
    assert held == pytest.approx(698.6e12 * 8192 / (8192 + kernels.GEMM_K0), rel=0.01)


def test_k_and_v_are_whole_heads_past_n_kv_heads():
    shape = cost.MODELS["Llama-3 70B"]            # 8 KV heads of 128
    assert kernels.linear_gemms(shape, 4096, 8)[0][1] == 8192 // 8 + 2 * 128
    assert kernels.linear_gemms(shape, 4096, 16)[0][1] == 8192 // 16 + 2 * 128   # not 64


def test_llm_foundrys_h100_rows_over_25_percent_are_named_by_the_stacks_h100_ratio(scored):
    # FOUNDRY_STACK (the pairs property asserted above) is the cause printed for them
    h100 = [(r, why) for r, why in scored["over"]
            if r["source"] == published.FOUNDRY and r["hardware"] == "H100 SXM"]
    # three since round fifteen's Hopper rate (the Large Scale table's 1B and 3B at 2048)
    assert len(h100) >= 3
    assert all("FOUNDRY_STACK" in why for _, why in h100)


def test_torchtitans_optimizer_is_foreach_adamw_whether_or_not_it_compiles():
    # torch/optim/adamw.py `_multi_tensor_adamw`: (read, written) fp32 bytes of each pass
    passes = {"decay mul_": (4, 4), "lerp_ m": (8, 4), "mul_ v": (4, 4),
              "addcmul_ v": (8, 4), "sqrt v": (4, 4), "div_": (4, 4), "add_ eps": (4, 4),
              "addcdiv_ params": (12, 4)}
    clipping = 4 + (4 + 4)          # get_total_norm, then clip_grads_with_norm_'s mul_
    per_param = sum(r + w for r, w in passes.values()) + clipping
    assert kernels.ADAM_BYTES + kernels.OPTIMIZER_EXTRA["foreach"] == per_param == 92
    for stack in ("torchtitan", "torchtitan+compile"):
        run = cost.TrainingRun("Llama-3 8B", "H100 96GB (500 W)", 8, global_batch=16,
                               micro_batch=2, seq_len=8192, sharding="fsdp", stack=stack)
        shard = kernels.local_params(run.shape, 1, 1) / 8
        assert cost.predict(run).breakdown["optimizer_s"] == pytest.approx(
            shard * per_param / run.hw.achievable_bandwidth)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fsdp2_copies_each_gather_out_on_the_compute_stream(monkeypatch, precision):
    run = dict(model="Llama-3 8B", hardware="H100 96GB (500 W)", gpus=8, global_batch=16,
               micro_batch=2, seq_len=8192, sharding="fsdp", precision=precision,
               stack="torchtitan+compile")
    with_copy = cost.predict(cost.TrainingRun(**run))
    old = cost.STACKS["torchtitan+compile"]
    monkeypatch.setitem(cost.STACKS, "torchtitan+compile",
                        dataclasses.replace(old, gather_copy=False))
    without = cost.predict(cost.TrainingRun(**run))
    shape = with_copy.run.shape
    n = kernels.local_params(shape, 1, 1)
    h, f, kv = shape.hidden, shape.ffn_size, shape.kv_dim
    linears = shape.layers * (2 * h * h + 2 * h * kv + 3 * h * f)   # fp8-gathered weights
    gathered = 2 * n - (linears if precision == "fp8" else 0)       # bytes of one gather
    # read once and written once, twice a step (resharded after forward): 2 x 2 x bytes
    expected = 2 * 2 * gathered / with_copy.run.hw.achievable_bandwidth
    assert with_copy.step_s - without.step_s == pytest.approx(expected)
