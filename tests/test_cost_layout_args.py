"""Issue 38 items 6, 7, 19: the cost API answers a typo with an error naming the argument,
never with "no layout fits"; fp8's MFU is over the fp8 peak."""

import pytest

from tplab import cost
from tplab.cost.training_run import TrainingRun, predict

GRID = dict(tps=(4, 8), pps=(1, 2), cps=(1,), vpps=(1,), micro_batches=(1,),
            shardings=("zero1",), recomputes=("full",))


@pytest.mark.parametrize("change, named", [
    (dict(hardware="H100 SMX"), "hardware"),
    (dict(model="Llama-3 70"), "model"),
    (dict(hardware="A100 SXM", precision="fp8"), "precision"),
    (dict(shardings="fsdp"), "shardings"),
    (dict(recomputes=("ful",)), "recomputes"),
    (dict(tps=(3,)), "tps"),
    (dict(tps=8), "tps"),
    (dict(pps=2), "pps"),
    (dict(global_batch=0), "global_batch"),
    (dict(gpus=0), "gpus"),
    (dict(gpus="256"), "gpus"),
])
@pytest.mark.parametrize("fn", [cost.best_layout, cost.layouts])
def test_an_argument_no_layout_could_take_is_an_error_naming_it(fn, change, named):
    args = dict(model="Llama-3 70B", hardware="H100 SXM", gpus=256, global_batch=256,
                seq_len=4096) | GRID | change
    with pytest.raises((ValueError, TypeError), match=named):
        fn(**args)


def test_a_typo_gets_the_closest_name():
    with pytest.raises(ValueError, match="H100 SXM"):
        cost.best_layout("Llama-3 70B", "H100 SMX", 256, 256, **GRID)


def test_a_grid_with_no_valid_layout_says_why_not_none():
    # 6 GPUs: tp 4 or 8 x pp 1 or 2 never divides them; every candidate breaks a rule
    with pytest.raises(ValueError, match="no layout .* valid.*gpus = 6"):
        cost.best_layout("Llama-3 70B", "H100 SXM", 6, 6, **GRID)


def test_none_means_nothing_fits_in_memory():
    # a valid grid on too few GPUs: every layout is valid, none fits in 80 GB
    grid = GRID | dict(tps=(1,), pps=(1,), recomputes=("none",))
    everything = cost.layouts("Llama-3 70B", "H100 SXM", 8, 8, seq_len=4096, **grid)
    assert everything and not any(p.fits for p in everything)
    assert cost.best_layout("Llama-3 70B", "H100 SXM", 8, 8, seq_len=4096, **grid) is None


def test_default_tps_are_the_degrees_the_heads_allow():
    shape = cost.MODELS["Llama-3 70B"].with_(heads=12, kv_heads=12, hidden=1536)
    got = cost.layouts(shape, "H100 SXM", 64, 64, seq_len=2048, pps=(1,), cps=(1,),
                       micro_batches=(1,), shardings=("zero1",), recomputes=("full",))
    assert {p.run.tp for p in got} == set(cost.allowed_tps(shape, (1, 2, 4, 8, 16)))


def test_fp8_mfu_is_over_the_fp8_peak():
    hw = cost.HARDWARE["H100 SXM"]
    run = TrainingRun("Llama-3 70B", hw, 512, tp=8, pp=4, micro_batch=1, global_batch=512,
                      seq_len=4096, precision="fp8", recompute="none")
    p = predict(run)
    flops = cost.training_run.model_flops_per_token(run.shape) * 512 * 4096
    assert p.mfu == pytest.approx(flops / (p.step_s * 512 * hw.fp8_flops))
    assert 0 < p.mfu < 1
    bf16 = predict(TrainingRun("Llama-3 70B", hw, 512, tp=8, pp=4, global_batch=512,
                               seq_len=4096, recompute="none"))
    assert bf16.mfu == pytest.approx(flops / (bf16.step_s * 512 * hw.flops))
