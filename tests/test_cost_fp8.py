"""fp8 as the stack that ran quantises it (`Stack.fp8_recipe`, docs/VALIDATION.md round
fourteen): Transformer Engine's delayed and current scaling against torchao's unfused
recipe, the TP all-gathers and the parameter gather in fp8."""

import dataclasses

import pytest

from tplab import cost
from tplab.cost import kernels, published, training_run
from tplab.cost.collectives import collective_time
from tplab.cost.transformer import block_collectives

H100, B200 = cost.HARDWARE["H100 SXM"], cost.HARDWARE["B200"]
# a gated block with grouped-query attention: h 1024, 8 heads of 128, 2 KV heads, f 2816
SHAPE = cost.BlockShape(hidden=1024, heads=8, kv_heads=2, ffn=2816, gated=True, seq=2048)


def te_bytes(tp: int, recipe: str, transposed: int) -> tuple[float, float]:
    """Transformer Engine's quantisation of one layer on one rank, element by element as
    TE 1.14 (delayed) and 2.9 (current) run Megatron's layer (kernels.te_cast_bytes cites
    the lines): a cast reads 2 and writes 1, current scaling reads 2 more for the amax;
    `transposed` (1 on Hopper) the column-wise copy, fused with the cast (+1) or a separate
    transpose of a gathered tensor (+2)."""
    t, h, f = SHAPE.seq, 1024, 2816
    amax = 2 if recipe == "te-current" else 0
    # the column-parallel outputs; past tp = 2 KV heads each rank holds a whole KV head
    qkv, fc1 = h // tp + 2 * max(256 // tp, 128), 2 * f // tp
    proj_in, fc2_in = h // tp, f // tp                  # the row-parallel inputs
    shard = t * h / tp                                  # an h-wide sequence shard (SP)
    if recipe == "te-delayed":    # the norm writes fp8; its gathered output transposed
        fwd, bwd = 0.0, 2 * 2 * transposed * t * h
        fwd += 3 * t * (proj_in + fc2_in)               # cast_to_fp8 under SP ...
        bwd += 2 * transposed * t * (proj_in + fc2_in)  # ... transposed in backward
    else:                         # the norm's amax fused; one cast of the shard
        fwd, bwd = 2 * 3 * shard, 2 * 2 * transposed * t * h
        fwd += (amax + 3 + transposed) * t * (proj_in + fc2_in)
    bwd += (amax + 3 + transposed) * t * (qkv + fc1)    # fused cast + transpose
    bwd += 2 * ((amax + 3) * shard + 2 * transposed * t * h)   # cast, gather, transpose
    return fwd, bwd


@pytest.mark.parametrize("recipe", ["te-delayed", "te-current"])
def test_transformer_engine_quantises_no_weight_and_fuses_its_casts(recipe):
    tp = 4
    assert kernels.fp8_cast_bytes(SHAPE, SHAPE.seq, tp, H100, recipe) == pytest.approx(
        te_bytes(tp, recipe, 1))
    assert kernels.fp8_cast_bytes(SHAPE, SHAPE.seq, tp, B200, recipe) == pytest.approx(
        te_bytes(tp, recipe, 0))
    # torchao's unfused recipe casts every operand, the weights each forward: more
    unfused = kernels.fp8_cast_bytes(SHAPE, SHAPE.seq, tp, H100)
    assert sum(unfused) > 1.5 * sum(te_bytes(tp, recipe, 1))
    with pytest.raises(ValueError, match="recipe"):
        kernels.fp8_cast_bytes(SHAPE, SHAPE.seq, tp, H100, "mxfp8")


def test_each_stack_names_its_fp8_recipe_and_dgxc_rows_name_delayed_scaling():
    recipes = {name: s.fp8_recipe for name, s in cost.STACKS.items()}
    assert recipes["megatron-bridge"] == "te-current"       # FP8-CS, bf16_with_fp8_cs
    assert recipes["megatron-lm"] == "te-delayed"            # TEDelayedScaling
    assert recipes["torchtitan"] == recipes["torchtitan+compile"] == "unfused"
    dgxc = [r for r in published.RUNS if r["source"] == published.DGXC
            and r["precision"] == "fp8"]
    assert dgxc and all(r["fp8_recipe"] == "te-delayed" for r in dgxc)
    assert all(published.to_run(r).settings.fp8_recipe == "te-delayed" for r in dgxc)
    bridge = [r for r in published.RUNS if r["source"] == published.BRIDGE]
    assert all("fp8_recipe" not in r for r in bridge)
    with pytest.raises(ValueError, match="fp8_recipe"):
        cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, precision="fp8", fp8_recipe="nvfp4")
    with pytest.raises(ValueError, match="fp8_recipe"):
        dataclasses.replace(cost.STACKS["megatron-lm"], fp8_recipe="delayed")


@pytest.mark.parametrize("recipe, in_fp8", [
    ("te-delayed", ("fwd_in", "fwd_out", "bwd_out", "regather")),   # fp8_buf RS too
    ("te-current", ("fwd_in", "bwd_out", "regather")),
    ("unfused", ())])
def test_te_gathers_its_tp_inputs_in_fp8(recipe, in_fp8):
    # nothing hidden (tp_overlap False): the exposed TP time is every collective's
    run = cost.TrainingRun("Llama-3 70B", "H100 SXM", 8, tp=8, precision="fp8",
                           stack="megatron-bridge", fp8_recipe=recipe, tp_overlap=False)
    local = run.shape
    want = sum(collective_time(r["op"], r["bytes"] / (2 if r["role"] in in_fp8 else 1),
                               8, run.hw, "auto")
               for r in block_collectives(local, 8, True, sp_saves="shard"))
    assert training_run.layer_times(run).tp_exposed_s == pytest.approx(want)


def test_fp8_primary_weights_are_gathered_in_one_byte(monkeypatch):
    run = dict(model="Llama-3 8B", hardware="H100 SXM", gpus=64, precision="fp8",
               stack="megatron-bridge", global_batch=64, grad_overlap=False)
    assert cost.STACKS["megatron-bridge"].fp8_params            # fp8_param_gather
    fp8 = cost.predict(cost.TrainingRun(**run)).breakdown["dp_comm_s"]
    monkeypatch.setitem(cost.STACKS, "megatron-bridge", dataclasses.replace(
        cost.STACKS["megatron-bridge"], fp8_params=False))
    bf16 = cost.predict(cost.TrainingRun(**run)).breakdown["dp_comm_s"]
    # ZeRO-1: one reduce-scatter of bf16 gradients and one all-gather of the parameters,
    # the same bytes in bf16, half of them in fp8
    assert fp8 == pytest.approx(0.75 * bf16, rel=0.05)
