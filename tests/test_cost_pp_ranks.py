"""What each pipeline rank holds under torch.distributed.pipelining (`tplab.cost.pp_ranks`)
and torchtitan's fp8-gathered weights, each number computed from the cited settings:
torchtitan 9dec370 (`generate_split_points`, 405B's shape, Tables 5 and 6 of
docs/performance.md at eaea6f6) and torch 2.6.0's Schedule1F1B, ScheduleInterleaved1F1B
and PipelineStage."""

import dataclasses

import pytest

from tplab import cost
from tplab.cost import memory, pipeline, pp_ranks, published

# Llama 3.1 405B (torchtitan's "405B" flavor): dim 16384, 8 KV heads of 128, FFN 53248,
# vocabulary 128256; Tables 5 and 6 run TP 8, PP 8, 32,768 tokens a micro-batch a rank
H, KV, F, V, TP, TOKENS = 16384, 8 * 128, 53248, 128256, 8, 32768
IO = TOKENS * H * 2 / TP                # a stage's bf16 input or output on one rank


def table5(schedule: str):
    row = next(r for r in published.RUNS if r["where"].startswith(f"Table 5: {schedule},"))
    return published.to_run(row)


def test_torchtitans_split_points_give_the_first_and_last_stage_one_layer_fewer():
    # generate_split_points: the first stage L // S, middles one more while L % S lasts
    assert pp_ranks.torchtitan_split(126, 8) == [15] + [16] * 6 + [15]
    assert pp_ranks.torchtitan_split(126, 16) == [7] + [8] * 14 + [7]
    assert pp_ranks.torchtitan_split(32, 4) == [8, 8, 8, 8]
    assert pp_ranks.torchtitan_split(10, 1) == [10]


def test_each_rank_runs_torchs_schedule_order():
    for rank in range(8):            # Schedule1F1B: min(m, S - stage) warm-up forwards
        ops = pp_ranks.rank_ops(8, 1, 8, rank)
        first_b = next(i for i, op in enumerate(ops) if op[1] == "B")
        assert first_b == min(8, 8 - rank)
        assert sorted(op[2] for op in ops if op[1] == "F") == list(range(8))
        assert sorted(op[2] for op in ops if op[1] == "B") == list(range(8))
    # ScheduleInterleaved1F1B, p 8, v 2, m 8: rank 0's warm-up, (v - 1) p + 2 (p - 1) = 22,
    # is capped at all m v = 16 chunk-forwards; rank 7's is p = 8, its first stage's forwards,
    # then the last stage alternates forward and backward, then the first stage's backwards
    ops = pp_ranks.rank_ops(8, 2, 8, 0)
    assert [op[1] for op in ops] == ["F"] * 16 + ["B"] * 16
    ops = pp_ranks.rank_ops(8, 2, 8, 7)
    assert ops[:8] == [(7, "F", i) for i in range(8)]
    assert ops[8:24] == [(15, k, i) for i in range(8) for k in ("F", "B")]
    assert ops[24:] == [(7, "B", i) for i in range(8)]


def test_torch_pipelining_keeps_buffers_outputs_and_the_last_stages_logits():
    # 1F1B: rank 0 (15 layers) holds all 8 micro-batches: each layer's saved input (full
    # recomputation), its output kept in output_chunks and the 8 gradient receive buffers
    run = table5("1F1B")
    layer = pipeline.layer_bytes(run, run.shape, "full")
    assert layer == pytest.approx(IO)
    peak = pipeline.memory(run)
    assert peak["activation_bytes"] == pytest.approx((15 * 8 + 8 + 8) * IO)
    assert peak["logits_bytes"] == 0
    # interleaved: rank 7 holds its first stage's 8 micro-batches (8 layers: receive and
    # gradient buffers, 7 more saved inputs, outputs) while the last stage (7 layers) keeps
    # every micro-batch's bf16 logits (V / t each) and runs the loss's backward (16 bytes a
    # logit under loss_parallel), with one micro-batch's 6 more inputs, the norm's input
    # and the output layer's sequence-gathered input (t IO) in flight
    run = table5("Interleaved 1F1B")
    peak = pipeline.memory(run)
    vocab = TOKENS * V / TP
    assert peak["logits_bytes"] == pytest.approx(8 * 2 * vocab + 16 * vocab)
    assert peak["activation_bytes"] == pytest.approx((8 + 8 + 8 * 7 + 8) * IO
                                                     + (8 + 6 + 1 + TP) * IO)
    # a stack with Megatron-LM's schedule counts the first stage's in-flight micro-batches:
    # ceil(126 / 8) layers x min(m, p + (p - 1) / v) = 16 x 8
    mega = dataclasses.replace(run, stack="megatron-lm", torch_cp=None)
    assert pipeline.memory(mega)["activation_bytes"] == pytest.approx(16 * 8 * IO)

def test_fp8_all_gather_keeps_one_byte_a_linear_weight_under_pp():
    # FSDP under PP keeps the stage's weights gathered; torchao's fsdp_post_all_gather wraps
    # the fp8 bytes: 1 byte a linear weight element, the rest (embedding, output, norms) bf16
    run = table5("1F1B")
    linear = (H * (H + 2 * KV) + H * H + 3 * H * F) / TP
    assert pipeline.linear_elements(run) == linear
    n = memory.param_count(run.shape, TP) / 8
    assert pipeline.memory(run)["param_bytes"] == pytest.approx(2 * n - linear * 126 / 8)
    bf16 = pipeline.memory(published.to_run(
        next(r for r in published.RUNS if r["where"].startswith("Table 5: 1F1B,")),
        precision="bf16"))
    assert bf16["param_bytes"] == pytest.approx(2 * n)


def test_an_unknown_pipelining_is_a_value_error_that_names_the_field():
    with pytest.raises(ValueError, match="pipelining"):
        cost.Stack("x", pipelining="deepspeed")
