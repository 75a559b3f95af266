"""cost.TrainingRun's memory and its data-parallel terms against what the sources' own code
keeps: MPT's block and loss, FSDP's fp32 master shard, DeepSpeed 2021's ZeRO-3 gathers,
torchtitan's op-level SAC and its TP inputs, the allocator's reserved bytes a printed peak
is, and one DP and memory model shared by step_time and TrainingRun (split from
tests/test_cost_runs.py)."""

import dataclasses
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

from tplab import cost
from tplab.cost import (
    kernels,
    megatron_ranks,
    memory,
    pipeline,
    published,
    training_run,
)

MiB = 2**20
LOSS_PEAK = pathlib.Path(__file__).parent / "scripts" / "loss_peak.py"
H100 = cost.HARDWARE["H100 SXM"]


def test_memory_counts_the_first_stages_in_flight_micro_batches_and_headroom():
    assert pipeline.in_flight(1, 1, 8) == 1
    assert pipeline.in_flight(8, 1, 64) == 8 and pipeline.in_flight(8, 1, 4) == 4
    assert pipeline.in_flight(8, 2, 64) == pytest.approx(8 * (1 + 7 / 16))
    # never more than the m micro-batches there are: with m = p the interleaved warm-up,
    # (v - 1) p + 2 (p - 1) chunk-forwards, is capped at all m v of them (Megatron-LM's
    # get_pp_rank_microbatches, torch's ScheduleInterleaved1F1B): torchtitan's Table 5
    # (p 8, v 2, m 8) and Llama 3's 16K-GPU rows (p 16, v 4, m 16) hold m, not p + (p-1)/v
    assert pipeline.in_flight(8, 2, 8) == 8 and pipeline.in_flight(16, 4, 16) == 16
    assert pipeline.in_flight(16, 4, 32) == pytest.approx(16 + 15 / 4)
    assert pipeline.in_flight(4, 2, 2) == 2
    rows = [r for r in published.RUNS if r["source"] == published.LLAMA3]
    fits = {r["gpus"]: cost.predict(published.to_run(r)).fits for r in rows}
    assert fits == {8192: False, 16384: True}          # as the paper is read (vpp 4, none)
    p = cost.predict(cost.TrainingRun("Llama-3.1 405B", "H100 SXM", 8, tp=8,
                                      global_batch=8, seq_len=8192))
    assert not p.fits                 # 405B on one node of H100 does not fit
    p = cost.predict(cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, global_batch=8,
                                      seq_len=8192, sharding="fsdp"))
    m = p.memory
    assert m["logits_bytes"] == 2 * 4 * 8192 * 128256
    assert m["headroom_bytes"] >= H100.memory_reserve + pipeline.NCCL_RESERVE
    assert p.memory_per_gpu == pytest.approx(sum(v for k, v in m.items() if k != "total_bytes"))


def test_op_recompute_keeps_what_torchtitans_op_level_sac_saves():
    # _save_list keeps mm outputs "except every second mm": of wq, wk, wv, wo, w1, w3, w2
    # the first, third, fifth and seventh; plus SDPA's output and logsumexp, and the input
    shape = cost.MODELS["Llama-3 8B"]
    saved = memory.op_sac_layer(shape)
    names = [s.module for s in saved if s.what == "mm output"]
    assert names == ["attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2"]
    h, kv, f = 4096, 1024, 14336
    assert sum(s.per_token * s.element_bytes for s in saved) == (
        2 * (h + h + kv + f + h + h) + 4 * 32)
    # against torchtitan's printed peaks of its op-SAC runs (Tables 1 and 3, 8 and 128 H100s)
    rows = [r for r in published.RUNS if r["recompute"] == "op" and r["peak_gib"]]
    assert len(rows) == 6
    for r in rows:
        p = cost.predict(published.to_run(r))
        assert p.fits and published.allocator_reserved(p) / 2**30 == pytest.approx(
            r["peak_gib"], rel=0.10)


def test_op_recompute_reruns_the_matmuls_op_level_sac_does_not_keep():
    # the same policy prices time: what is not kept is re-run (wk, wo, w3), plus the
    # element-wise ops; the kept mm's (wq, wv, w1, w2) and attention are not
    run = cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, seq_len=8192, recompute="op",
                           sharding="fsdp", stack="torchtitan")
    none = dataclasses.replace(run, recompute="none")
    lt, base = training_run.layer_times(run), training_run.layer_times(none)
    t = 8192
    rerun = sum(kernels.gemm_time(m, n, k, run.hw) for m, n, k in (
        (t, 1024, 4096), (t, 4096, 4096), (t, 14336, 4096)))
    assert lt.backward_s - base.backward_s == pytest.approx(rerun + lt.elementwise_s)
    assert rerun < 0.5 * lt.gemm_fwd_s          # under half the layer's linear FLOPs


def test_mpts_block_saves_what_llm_foundrys_code_keeps_and_its_runs_fit():
    # memory.mpt_layer, read from llm-foundry v0.3.0: per token 32h + 4a + 16 bytes (no
    # dropout masks at p = 0, q, k, v views of one qkv tensor, flash's fp32 logsumexp)
    shape = cost.MODELS["MPT 760M"]
    h, a = shape.hidden, shape.heads
    assert sum(s.per_token * s.element_bytes for s in memory.mpt_layer(shape)) == (
        32 * h + 4 * a + 16)
    assert cost.STACKS["llm-foundry-2023"].block == "mpt"
    # flash-attn 1.0.9's fused cross entropy: bf16 logits and their bf16 gradient
    assert cost.STACKS["llm-foundry-2023"].logits_bytes == 4
    # the 760M rows at 24 x 2048 tokens without recomputation ran on 80 GB (the model of
    # the last round said 88 GiB: the GPT layer's dropout masks, 8 bytes per logit)
    rows = [r for r in published.RUNS if r["source"] == published.FOUNDRY
            and r["model"] == "MPT 760M" and r["recompute"] == "none"]
    assert len(rows) >= 10
    for r in rows:
        p = cost.predict(published.to_run(r))
        assert p.fits, (r["where"], p.memory_per_gpu / 2**30)


def test_a_fully_sharded_rank_keeps_the_fp32_shard_as_its_master():
    # FSDP's sharded parameter is the fp32 one the optimizer steps: 4 + 4 + 8 bytes per
    # parameter over the shard, where ZeRO-1 keeps bf16 parameters, fp32 gradients and
    # 12 bytes of optimizer state (6 + 12/d)
    kw = dict(model="Llama-3 8B", hardware="H100 SXM", gpus=8, global_batch=8, seq_len=4096)
    fsdp = cost.predict(cost.TrainingRun(**kw, sharding="fsdp")).memory
    zero1 = cost.predict(cost.TrainingRun(**kw, sharding="zero1")).memory
    n = zero1["param_bytes"] / 2
    assert fsdp["param_bytes"] + fsdp["grad_bytes"] + fsdp["optimizer_bytes"] == \
        pytest.approx(16 * n / 8)
    assert zero1["grad_bytes"] + zero1["optimizer_bytes"] == pytest.approx(4 * n + 12 * n / 8)


def test_deepspeed_2021_gathers_one_parameter_at_a_time_so_its_zero3_rows_fit():
    # DEEPSPEED_ZERO3_2021: one all_gather per parameter, the next prefetched within
    # prefetch_bucket_size (5e7 elements): not two whole layers of 529.6B (5e9 elements)
    zero3 = [r for r in published.RUNS if r["stack"] == "deepspeed-2021"]
    for r in zero3:
        p = cost.predict(published.to_run(r))
        assert p.fits, (r["where"], p.memory_per_gpu / 2**30)
    run = published.to_run(max(zero3, key=lambda r: r["shape"].hidden))
    h = run.shape.hidden
    per_layer = 12 * h * h                              # GPT: qkv 3h^2, wo h^2, fc 8h^2
    held = pipeline.gathered_elements(run, per_layer)
    assert held == 4 * h * h + 5e7                      # fc1, the largest, and the bucket
    assert held < 2 * per_layer / 5


def test_printed_peaks_are_the_allocators_reserved_bytes():
    # torchtitan logs max_reserved_gib (torch.cuda.memory_stats' reserved_bytes.all.peak):
    # the model's bytes less what lives outside the allocator (NCCL's, the CUDA context)
    r = next(r for r in published.RUNS if r["peak_gib"])
    p = cost.predict(published.to_run(r))
    assert published.allocator_reserved(p) == pytest.approx(
        p.memory_per_gpu - pipeline.NCCL_RESERVE - p.run.hw.memory_reserve)
    assert cost.STACKS["torchtitan"].logits_bytes == 12


def test_torchtitans_tp_keeps_each_linears_gathered_input_whole():
    # apply_tp (9dec370): PrepareModuleInput turns the Shard(1) norm output Replicate before
    # wq/wk/wv and w1/w3, so those linears keep the whole sequence; Megatron-LM keeps 1/t
    run = cost.TrainingRun("Llama-3 70B", "H100 SXM", 8, tp=8, global_batch=8, seq_len=8192,
                           stack="torchtitan+compile")
    megatron = dataclasses.replace(run, stack="megatron-lm")
    assert run.settings.sp_saves == "gathered" and megatron.settings.sp_saves == "shard"
    extra = (pipeline.layer_bytes(run, run.shape, "selective")
             - pipeline.layer_bytes(megatron, run.shape, "selective"))
    assert extra == pytest.approx(2 * 2 * 8192 * 8192 * 8192 * (1 - 1 / 8) / 8192)


def _loss_peaks() -> tuple[float, float]:
    """tests/scripts/loss_peak.py's two measurements, in this process when no group of more
    than one rank is up here, else in a process of their own."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        spec = importlib.util.spec_from_file_location("loss_peak", LOSS_PEAK)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.measure()
    out = subprocess.run([sys.executable, str(LOSS_PEAK)], capture_output=True, text=True,
                         check=True, timeout=600).stdout.split()
    return float(out[1]), float(out[3])


def test_torchtitans_loss_under_tp_peaks_at_loss_parallels_16_bytes_a_logit():
    # torchtitan runs its loss under torch's loss_parallel whenever TP > 1; measured here
    # on a one-rank mesh against ATen's fused backward, and the model's counts of each
    plain, parallel = _loss_peaks()
    # within a byte (the process's other allocations move the resident set a little);
    # the two counts are 4 bytes apart
    titan = cost.STACKS["torchtitan+compile"]
    assert plain == pytest.approx(titan.logits_bytes, abs=1.0)
    assert parallel == pytest.approx(titan.tp_logits_bytes, abs=1.0)
    for tp in (1, 8):
        run = cost.TrainingRun("Llama-3 70B", "H100 SXM", 8 * tp, tp=tp, global_batch=8,
                               seq_len=8192, sharding="fsdp", stack="torchtitan+compile")
        logits = pipeline.memory(run)["logits_bytes"] / (8192 * 128256 / tp)
        assert logits == pytest.approx(plain if tp == 1 else parallel, abs=1.0)
    # Table 4's two 2D runs (70B, TP 8, FSDP 32) now meet their printed peaks
    for r in (r for r in published.RUNS if r["peak_gib"] and r["tp"] > 1 and r["pp"] == 1):
        p = cost.predict(published.to_run(r))
        assert published.allocator_reserved(p) / 2**30 == pytest.approx(r["peak_gib"],
                                                                          rel=0.10)


def test_blackwell_presets_hold_the_memory_cuda_reports_not_the_datasheets_gb_as_1e9():
    # pytorch/ao#4002's device query on B200: "Total Global Memory: 178.35 GB" (GiB);
    # vllm#43951 on GB200: "a total capacity of 184.31 GiB". The datasheets' "180 GB" and
    # "186 GB" read as 1e9 bytes (the presets before) are 167.6 and 173.2 GiB
    for name, gib, datasheet in (("B200", 178.35, 180), ("GB200 NVL72", 184.31, 186)):
        memory = cost.HARDWARE[name].memory
        assert memory / 2**30 == pytest.approx(gib, abs=0.01)
        assert memory > datasheet * 1e9 * 1.05
    # the other presets hold nvidia-smi's MiB, within a GiB of CUDA's figure
    assert cost.HARDWARE["H100 SXM"].memory == 81559 * MiB


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "zero2", "fsdp"])
def test_step_time_and_training_run_share_one_dp_and_memory_model(sharding):
    # issue 36 item 3: dp_times / gpu_memory (step_time's terms) and TrainingRun's are the
    # same functions (data_parallel.sync_seconds, memory.state_bytes): the same run, asked
    # both ways, costs the same DP seconds and holds the same model-state bytes
    zero = memory.ZERO_STAGES[sharding]
    run = cost.TrainingRun("Llama-3 8B", "H100 SXM", 64, tp=2, global_batch=128,
                           seq_len=4096, sharding=sharding, recompute="selective")
    p, m = cost.predict(run), run.micro_batches
    assert m == 4
    lt = training_run.layer_times(run)
    layers = run.shape.layers
    dp = cost.dp_times(run.shape, run.tp, run.hw, dp=run.dp, zero=zero, micro_batches=m,
                       forward_s=layers * lt.forward_s, backward_s=layers * lt.backward_s)
    assert m * dp["dp_comm_s"] == pytest.approx(p.breakdown["dp_comm_s"])
    assert m * dp["dp_exposed_s"] == pytest.approx(p.breakdown["dp_exposed_s"])
    states = cost.gpu_memory(run.shape, run.tp, True, run.recompute, dp=run.dp, zero=zero,
                             **cost.BLOCK_SAVES["megatron"])
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"):
        assert states[key] == pytest.approx(p.memory[key]), key
    # a gradient reduce-scatter overlaps the backward only, not the forward before it
    if sharding == "zero2":
        rs = next(r["time_s"] for r in dp["dp_records"] if r["op"] == "reduce_scatter")
        behind = layers * lt.backward_s
        assert m * dp["dp_exposed_s"] >= m * max(0.0, rs - behind)


def test_nemo_and_bridge_benchmark_recipes_reduce_gradients_in_bf16_as_their_log_peak_says():
    # Megatron-Bridge's and NeMo 2's performance recipes set grad_reduce_in_fp32 = False
    # and NeMo 1's yamls set Apex's grad_sync_dtype: bf16 (cost.STACKS "megatron-bridge"):
    # the gradient buffer is bf16, 2 bytes a parameter, and the DP reduce-scatter moves half
    bridge = cost.STACKS["megatron-bridge"]
    assert bridge.grad_bytes == 2 and cost.STACKS["megatron-lm"].grad_bytes == 4
    assert all(c in bridge.cites for c in ("grad_reduce_in_fp32", "d2b21556", "grad_sync_dtype"))
    kw = dict(model="Llama-3 8B", hardware="H100 SXM", gpus=8, cp=2, global_batch=128,
              seq_len=8192)
    bf16 = cost.predict(cost.TrainingRun(**kw, stack="megatron-bridge"))
    fp32 = cost.predict(cost.TrainingRun(**kw, stack="megatron-bridge", grad_bytes=4))
    assert bf16.memory["grad_bytes"] == pytest.approx(fp32.memory["grad_bytes"] / 2)
    assert bf16.breakdown["dp_comm_s"] < fp32.breakdown["dp_comm_s"]
    with pytest.raises(ValueError, match="grad_bytes = 3"):
        cost.TrainingRun(**kw, grad_bytes=3)
    # dgxc v25.04.01's README logs that run (8B BF16, 8 H100s, GBS 128):
    # peak_memory_usage, NeMo's torch.cuda.max_memory_reserved(), 70833405952 bytes;
    # with fp32 gradients the model holds 79 GiB and says the run does not fit
    row = next(r for r in published.RUNS if r.get("peak_gib") and r["source"] == published.DGXC)
    assert row["peak_gib"] == pytest.approx(70833405952 / 2**30, abs=0.01)
    p = cost.predict(published.to_run(row))
    assert p.fits and not cost.predict(published.to_run(row, grad_bytes=4)).fits
    assert published.allocator_reserved(p) / 2**30 == pytest.approx(row["peak_gib"], rel=0.05)
    # every dgxc row fits as its recipe sets it (no recomputation): none needs the full
    # recomputation published.fitting falls back to
    out = published.compare([r for r in published.RUNS if r["source"] == published.DGXC])
    assert not [r["where"] for r in out["rows"] if r["fit_setting"]]


def test_torch_context_parallel_holds_the_gathered_kv_and_fp32_gradient_buffers():
    # torch's ring attention backward (torch/distributed/tensor/experimental/_attention.py,
    # rotate method "allgather", torchtitan's default at 9dec370) all-gathers K and V whole
    # in bf16 and, at the dK/dV exchange, keeps dq, the received dK/dV, the next dK/dV
    # send, the all-to-all's output and _partial_update's copies in fp32 (convert_to_f32)
    # with next_kv in bf16: 4 cp E + 40 E bytes, E one of q, k, v on a rank with K and V
    # repeated to every query head (torchtitan's repeat_kv)
    rows = [r for r in published.RUNS if r["peak_gib"] and r["pp"] > 1 and r["vpp"] == 1]
    runs = {r["cp"]: published.to_run(r) for r in rows if "4D" in r["where"]}
    assert sorted(runs) == [1, 2, 4, 8]
    for cp, run in runs.items():
        e = run.shape.batch * run.shape.seq // cp * 16 * 128    # 405B: 128 heads / TP 8
        assert pipeline.torch_cp_backward_bytes(run) == (4 * cp * e + 40 * e if cp > 1 else 0)
        megatron = dataclasses.replace(run, stack="megatron-lm", torch_cp=None)
        assert pipeline.torch_cp_backward_bytes(megatron) == 0     # TE's CP: not this code
    peak = {cp: cost.predict(run).memory_per_gpu for cp, run in runs.items()}
    assert peak[1] < peak[2] < peak[4] < peak[8]     # Table 6 grows with CP, as printed
    # with pp > 1 the largest rank is the first (tplab.cost.pp_ranks): its layer's backward
    # holds the buffers on top of its in-flight micro-batches, headroom included
    for run in runs.values():
        without = dataclasses.replace(run, torch_cp=False)
        assert (cost.predict(run).memory_per_gpu - cost.predict(without).memory_per_gpu
                == pytest.approx((1 + pipeline.FRAGMENTATION)
                                 * pipeline.torch_cp_backward_bytes(run)))
    # the ring's buffers live inside one attention backward, the loss's before the first
    # layer's: with pp = 1 only their excess over the loss counts (Table 2 stays flat)
    flat = [cost.predict(published.to_run(r)).memory_per_gpu for r in published.RUNS
            if r["peak_gib"] and r["pp"] == 1 and r["cp"] > 1 and "torchtitan" in r["stack"]]
    assert len(flat) == 3 and max(flat) == pytest.approx(min(flat))


def bridge_405b_gb200_fp8(expandable_segments=False, **changes):
    """Megatron-Bridge's GB200 405B FP8-CS layout (LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V2,
    scripts/performance/configs/llama/llama31_workload_base_configs.py at v0.3.0: TP 4,
    PP 16, VP 4, CP 1, 256 GPUs, GBS 1536, micro-batch 1, no recomputation, no offload);
    `changes`: fields of the stack it runs on."""
    run = cost.TrainingRun("Llama-3.1 405B", "GB200 NVL72", 256, tp=4, pp=16, vpp=4,
                           global_batch=1536, seq_len=8192, precision="fp8",
                           sharding="zero1", stack="megatron-bridge",
                           expandable_segments=expandable_segments)
    if changes:
        object.__setattr__(run, "settings", dataclasses.replace(run.settings, **changes))
    return run


def test_transformer_engine_keeps_every_linears_input_in_fp8():
    # TE's Linear saves its own quantised input (linear.py at TE 5671fd36): FC2 keeps the
    # SwiGLU output at 1 byte (Megatron's fused SwiGLU keeps only its 2f input), the output
    # projection an fp8 copy beside the attention kernel's bf16 output. Per token and layer
    # at TP 4 with SP: the norms' bf16 input and fp32 rstd, the QKV and FC1 inputs (1 byte),
    # q, k, v, the attention output (bf16), the logsumexp, the SwiGLU input (bf16, 2f),
    # FC2's and the projection's fp8 inputs
    run = bridge_405b_gb200_fp8()
    s, t = run.shape, 4
    h, f, kv, a = s.hidden, s.ffn_size, s.kv_dim, s.heads
    per_token = (2 * (2 * h + 4) + 2 * h + 2 * (2 * h + 2 * kv) + 4 * a + 4 * f + f + h) / t
    assert per_token == 112_770
    local = s.with_(seq=s.seq)
    assert pipeline.layer_bytes(run, local, "selective") == per_token * s.tokens
    bf16_fc2 = bridge_405b_gb200_fp8(te_fp8=False)
    assert pipeline.layer_bytes(bf16_fc2, local, "selective") == pytest.approx(
        (per_token + (f - h) / t) * s.tokens)
    # full recomputation keeps the layer input only, as before
    assert pipeline.layer_bytes(run, local, "full") == 2 * h / t * s.tokens


def test_megatrons_most_loaded_rank_under_the_embedding_and_loss_split():
    # account_for_embedding/loss_in_pipeline_split (get_num_layers_to_build): L = 6 over
    # p 2, v 2 is (6 + 2) / 4 = 2 a chunk, 1 in rank 0's first and rank 1's last. Megatron's
    # schedule with m 4 (groups of p: chunks 0 0 1 1 0 0 1 1; backwards reversed): rank 0
    # warms up 2 (p - 1) + (v - 1) p = 4 forwards (1 + 1 + 2 + 2) and peaks at 7 with the
    # next chunk-0 forward; rank 1 warms up 2 (2 + 2) and peaks at 6
    chunks = [megatron_ranks.chunk_layers(6, 2, 2, r, c) for r in (0, 1) for c in (0, 1)]
    assert chunks == [1, 2, 2, 1]
    assert megatron_ranks.rank_peak_layers(6, 2, 2, 4, 0) == 7
    assert megatron_ranks.rank_peak_layers(6, 2, 2, 4, 1) == 6
    # the GB200 405B layout: rank 1 holds 2 (p - 2) + (v - 1) p + 1 = 77 chunk-forwards of
    # (126 + 2) / 64 = 2 layers, where the first stage's ceil(126 / 16) x (p + (p - 1) / v)
    # is 158; rank 0 holds 31 one-layer first chunks among its 79
    run = bridge_405b_gb200_fp8()
    assert pipeline.held_layers(run) == (154, 1)
    assert megatron_ranks.rank_peak_layers(126, 16, 4, 384, 0) == 79 * 2 - 31
    assert pipeline.held_layers(bridge_405b_gb200_fp8(embedding_slot=False))[0] == 158
    # the rank's own parameters: 8 layers, no embedding
    layer = memory.param_count(run.shape.with_(layers=1, vocab=0), 4)
    assert megatron_ranks.rank_params(run, 1) == pytest.approx(8 * layer)
    # torchtitan splits its own way: unchanged
    titan = cost.TrainingRun("Llama-3.1 405B", "H100 SXM", 512, tp=8, pp=8, global_batch=64,
                             seq_len=8192, stack="torchtitan+compile", sharding="fsdp")
    assert pipeline.held_layers(titan) == (16 * pipeline.in_flight(8, 1, titan.micro_batches),
                                           None)


def test_fp8_primary_weights_are_one_byte_on_blackwell_only():
    # fp8_param_gather (bf16_with_fp8_current_scaling_mixed): the blocks' matrices are
    # Float8Tensors; Blackwell keeps no transposed copy (quantizer.cpp, sm 10.x), Hopper does
    run = bridge_405b_gb200_fp8()
    s = run.shape
    h, f, kv = s.hidden, s.ffn_size, s.kv_dim
    matrices = h * (h + 2 * kv) + h * h + 3 * h * f
    assert pipeline.fp8_param_saving(run, 1) == pytest.approx(8 * matrices / 4)
    assert pipeline.fp8_param_saving(bridge_405b_gb200_fp8(fp8_params=False), 1) == 0
    hopper = cost.TrainingRun("Llama-3.1 405B", "H100 SXM", 1024, tp=8, pp=8, vpp=8, cp=2,
                              global_batch=1536, seq_len=8192, precision="fp8",
                              sharding="zero1", stack="megatron-bridge")
    assert pipeline.fp8_param_saving(hopper, 1) == 0


def test_gb200_405b_fp8_fits_with_the_expandable_segments_its_recipe_sets():
    # with what TE keeps in fp8, fp8 weights and Megatron's most loaded rank the run's own
    # setting (no recomputation) sits within the 10% fragmentation assumption of the card's
    # 184.31 GiB. Its recipe runs the allocator with expandable segments (Megatron-Bridge
    # perf_plugins.py, llama31 405B on GB200 in fp8_cs/fp8_mx, v0.2.0 to v0.4.2), which
    # unmaps the free pages between live blocks before it gives up: no slack counts then
    run = bridge_405b_gb200_fp8()
    p = cost.predict(run)
    margin = p.memory["total_bytes"] - run.hw.memory
    slack = pipeline.FRAGMENTATION * (p.memory["activation_bytes"]
                                      + p.memory["transient_bytes"] + p.memory["logits_bytes"])
    assert 0 < margin < slack and not p.fits
    q = cost.predict(bridge_405b_gb200_fp8(expandable_segments=True))
    assert q.fits and q.memory_per_gpu == pytest.approx(p.memory_per_gpu - slack)
    assert q.step_s == p.step_s                       # memory only: the step is the same
    rows = [r for r in published.RUNS if r.get("expandable_segments")]
    assert len(rows) == 6 and all(
        r["hardware"] == "GB200 NVL72" and r["model"] == "Llama-3.1 405B"
        and r["precision"] == "fp8" and cost.predict(published.to_run(r)).fits for r in rows)
    with pytest.raises(TypeError, match="expandable_segments"):
        cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, expandable_segments="yes")
    before = pipeline.memory(bridge_405b_gb200_fp8(te_fp8=False, fp8_params=False,
                                                   embedding_slot=False))
    assert before["total_bytes"] - run.hw.memory > 20 * 2**30
