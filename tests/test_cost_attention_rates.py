"""Flash attention priced by kernel and shape where it was measured (tplab.cost.attention_rates,
issue 35): the table is the H200 run's, interpolated, and used by the stacks that run each
kernel on Hopper; other architectures keep the preset's one rate."""

import json
import pathlib
import statistics
import subprocess
import sys

import pytest

from tplab import cost
from tplab.cost import attention_rates
from tplab.cost.attention_rates import KERNELS
from tplab.cost.training_run import attention_rates_of, layer_times

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu-layer-2026-12-04.json"


def test_the_table_is_the_one_the_recorded_run_gives():
    # benchmarks/attention_table.py re-derives it from the H200 run's numbers; a hand edit
    # of data/kernels/attention_hopper.json fails here
    done = subprocess.run([sys.executable, "benchmarks/attention_table.py", "--check"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr


def test_fraction_is_the_median_at_a_measured_point_and_between_neighbours_elsewhere():
    results = json.loads(RESULTS.read_text())
    rows = [r for r in results["attention"] if r["backend"] == "flash"
            and r["batch"] * r["heads"] == 8 and r["seq"] == 8192]
    fwd = [2 * r["batch"] * r["seq"] ** 2 * r["heads"] * 128 / (r["fwd_ms"] * 1e-3) / 989e12
           for r in rows]
    assert len(fwd) == 3                        # b1 h8, b2 h4, b4 h2
    assert attention_rates.fraction("fa2", 8, 8192) == pytest.approx(
        statistics.median(fwd), abs=1e-4)
    # between the measured points, in each direction
    lo, hi = attention_rates.fraction("fa2", 8, 8192), attention_rates.fraction("fa2", 16, 8192)
    assert lo < attention_rates.fraction("fa2", 12, 8192) < hi
    short, long_ = (attention_rates.fraction("cudnn", 16, s) for s in (4096, 8192))
    assert short < attention_rates.fraction("cudnn", 16, 6000) < long_
    # the ends are held
    assert attention_rates.fraction("cudnn", 1, 512) == attention_rates.fraction("cudnn", 2, 2048)
    big = attention_rates.fraction("fa2", 1e4, 1e6, backward=True)
    assert big == attention_rates.TABLE["kernels"]["fa2"]["by_seq"]["32768"]["backward"][-1]


def test_cudnn_runs_about_twice_fa2_on_large_calls_and_both_fall_on_small_ones():
    for backward in (False, True):
        for bh, seq in ((64, 8192), (32, 16384)):
            fa2, cudnn = (attention_rates.fraction(k, bh, seq, backward) for k in KERNELS)
            assert 1.5 < cudnn / fa2 < 2.2
        assert attention_rates.fraction("fa2", 2, 8192, backward) < 0.65 * \
            attention_rates.fraction("fa2", 64, 8192, backward)
    # at one b h s, a shorter sequence is slower: each CTA's work grows with s
    assert attention_rates.fraction("cudnn", 32, 2048) < 0.7 * attention_rates.fraction(
        "cudnn", 2, 32768)


def test_few_heads_per_rank_price_attention_slower_per_flop_on_hopper_only():
    def per_flop(hardware, tp, kernel):
        run = cost.TrainingRun("Llama-3 70B", hardware, 8, tp=tp, seq_len=4096,
                               stack="torchtitan", attention_kernel=kernel)
        flops = 2 * run.shape.seq ** 2 * run.shape.hidden / tp
        return layer_times(run).attention_s / flops

    for kernel in ("fa2", "cudnn"):
        # 70B at TP 8 keeps 8 of 64 heads, TP 1 all 64, at 4096 tokens
        assert per_flop("H100 SXM", 8, kernel) > 1.5 * per_flop("H100 SXM", 1, kernel)
    assert per_flop("A100 SXM", 8, "fa2") == pytest.approx(per_flop("A100 SXM", 1, "fa2"))
    assert per_flop("A100 SXM", 8, "cudnn") == per_flop("A100 SXM", 8, "fa2")


def test_the_stack_names_its_kernel_and_a_run_may_override_it():
    run = cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, stack="megatron-bridge")
    assert run.attention_kernel == "cudnn"
    fa2 = cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, stack="megatron-bridge",
                           attention_kernel="fa2")
    assert attention_rates_of(fa2)[0] < attention_rates_of(run)[0]
    assert cost.predict(fa2).step_s > cost.predict(run).step_s
    # llm-foundry's FA1-class kernel scales FA2's measured rate
    mpt = cost.TrainingRun("MPT 7B", "H100 SXM", 8, stack="llm-foundry-2023", seq_len=2048)
    plain = cost.TrainingRun("MPT 7B", "H100 SXM", 8, stack="torchtitan", seq_len=2048)
    scale = cost.STACKS["llm-foundry-2023"].attention_scale
    assert attention_rates_of(mpt)[0] == pytest.approx(scale * attention_rates_of(plain)[0])


def test_bad_kernel_names_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="attention_kernel"):
        cost.TrainingRun("Llama-3 8B", "H100 SXM", 8, attention_kernel="fa3")
    with pytest.raises(ValueError, match="attention_kernel"):
        cost.Stack("mine", attention_kernel="triton")
    with pytest.raises(ValueError, match="attention kernel"):
        attention_rates.fraction("xformers", 8, 1024)
    with pytest.raises(ValueError, match="batch_heads"):
        attention_rates.fraction("fa2", -1, 1024)
    with pytest.raises(ValueError, match="seq"):
        attention_rates.fraction("fa2", 8, 0)


def test_the_model_meets_the_recorded_layer_on_the_h200():
    # benchmarks/gpu_layer.py on one H200: Llama-3 8B's attention at 8192 tokens, micro-batch
    # 1 and 2 (32 heads: 262,144 and 524,288 rows of work), cuDNN; the model at the burst
    # clock the short run saw; the table holds medians over shapes, each within about 15%
    results = json.loads(RESULTS.read_text())
    hw = cost.HARDWARE["H200 SXM"].with_(sustained=1.0)
    rows = [r for r in results["layer"] if r["model"] == "Llama-3 8B" and r["tp"] == 1]
    assert len(rows) == 2
    for row in rows:
        run = cost.TrainingRun("Llama-3 8B", hw, 1, micro_batch=row["micro_batch"],
                               seq_len=8192, stack="torchtitan", attention_kernel="cudnn")
        lt = layer_times(run)
        measured = row["measured_ms"]["attention_cudnn"]
        assert lt.attention_s * 1e3 == pytest.approx(measured["fwd"], rel=0.15)
        backward = lt.backward_s - 2 * lt.gemm_fwd_s - 2 * lt.elementwise_s
        assert backward * 1e3 == pytest.approx(measured["bwd"], rel=0.15)

