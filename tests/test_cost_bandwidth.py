"""Memory-bound work at the bandwidth a copy reaches, not the datasheet's (round thirteen,
docs/VALIDATION.md): `hardware.HBM_EFFICIENCY` on every preset, and what it does held out."""

import contextlib
import json
from pathlib import Path

import pytest

from tplab import cost
from tplab.cost import kernels, scores
from tplab.cost.hardware import HARDWARE, HBM_EFFICIENCY

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_hbm_efficiency_is_the_h200s_measured_copy():
    # benchmarks/results/gpu-2026-12-04.json: a 4 GiB device-to-device copy on one H200
    rates = json.loads((RESULTS / "gpu-2026-12-04.json").read_text())["rates"]
    measured = rates["bandwidth"]["tb_s"] * 1e12 / rates["preset"]["memory_bandwidth"]
    assert measured == pytest.approx(HBM_EFFICIENCY, abs=5e-4)


def test_memory_bound_work_runs_at_the_achievable_bandwidth_on_every_preset():
    for hw in HARDWARE.values():
        assert hw.memory_efficiency == HBM_EFFICIENCY
        assert hw.achievable_bandwidth == pytest.approx(hw.memory_bandwidth * HBM_EFFICIENCY)
    h100, shape = HARDWARE["H100 SXM"], cost.MODELS["Llama-3 8B"]
    n = kernels.local_params(shape, 1, 1)
    adam = n * (kernels.ADAM_BYTES + kernels.OPTIMIZER_EXTRA["fused"])
    assert kernels.optimizer_time(shape, 1, 1, 8, "ddp", h100) == pytest.approx(
        adam / (3.35e12 * 0.896))
    datasheet = h100.with_(memory_efficiency=1.0)
    assert kernels.optimizer_time(shape, 1, 1, 8, "ddp", datasheet) == pytest.approx(
        adam / 3.35e12)
    with pytest.raises(ValueError):
        h100.with_(memory_efficiency=1.2)


@contextlib.contextmanager
def every_preset(**changes):
    old = dict(HARDWARE)
    HARDWARE.update({name: hw.with_(**changes) for name, hw in old.items()})
    try:
        yield
    finally:
        HARDWARE.update(old)


def test_the_copy_fraction_helps_held_out():
    # the frozen protocol: each source held out, the factor fit on the rest; the datasheet
    # (memory_efficiency 1) is the alternative (benchmarks/published_choices.py prints both)
    kept = scores.score()
    with every_preset(memory_efficiency=1.0):
        datasheet = scores.score()
    worst = {name: max(v["after"] for v in s["loso_goal"].values())
             for name, s in (("kept", kept), ("datasheet", datasheet))}
    assert worst["kept"] < worst["datasheet"]                     # 18.9% vs 19.2%
    better = sum(kept["loso_goal"][s]["after"] < v["after"]
                 for s, v in datasheet["loso_goal"].items())
    worse = [kept["loso_goal"][s]["after"] - v["after"]
             for s, v in datasheet["loso_goal"].items()]
    # of 8 sources, round fourteen: 5 better, dgxc and Korthikanti equal, Megatron-Bridge
    # 0.3 and Narayanan 0.5 points worse; since torchtitan's foreach AdamW and FSDP2
    # copy-out (memory-bound, i35-titan): 5 better, Megatron-Bridge 0.2, Narayanan 0.2 and
    # torchtitan A100 0.7 points worse (2.2% vs 1.4%); with round fifteen's Llama 3 and
    # GB200 readings moving the factor fit on the rest, 6 better and torchtitan A100 0.8
    # (2.3% vs 1.5%). The bound is a point, not the last figure plus a margin: a choice that
    # costs any held-out source a point or more is not kept (docs/VALIDATION.md)
    assert better >= 5 and max(worse) < 0.01
    assert kept["goal"]["median"] < datasheet["goal"]["median"]   # 10.8% vs 11.2%
    good, total = kept["pairs_goal"]
    assert good / total >= 0.95
