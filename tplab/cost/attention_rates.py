"""Flash attention's rate by kernel and shape, measured (issue 35): the rate a run's attention
kernel reaches depends on which kernel its stack runs and on how much work one call has.

On one H200 (benchmarks/gpu_layer.py; the table is data/kernels/attention_hopper.json,
written by benchmarks/attention_table.py from benchmarks/results/gpu-layer-2026-12-04.json),
causal bf16 attention with heads of width 128:

- torch's FlashAttention-2 backend ("fa2") reaches 0.35 of the dense bf16 peak forward and
  0.31 backward on large calls, the 0.35 `Hardware.attention_efficiency` held for every
  Hopper shape, but 0.22 / 0.23 at 65,536 rows of work and 0.11 at 16,384;
- cuDNN's fused attention ("cudnn", the kernel class Transformer Engine runs on Hopper)
  reaches 0.61-0.65 forward and 0.55 backward on large calls, falling likewise on small ones.

The rows of work are x = micro-batch x query heads on the rank x the rank's sequence: the
kernels' grid holds one CTA per 128 query rows of one head, and at each x the rate varies
little with how x is made up (fa2 forward within 0.20-0.24 over twelve shapes at x = 65,536).
`fraction` interpolates the medians linearly in log x and holds the ends. Measured on the
Hopper architecture (`Hardware.arch` "hopper"), as fractions of the peak, so every Hopper
preset uses it; other architectures keep `attention_efficiency` (no measurement here).
"""

from __future__ import annotations

import json
import math
import pathlib

from tplab.cost.validate import check_choice, check_number

KERNELS = ("fa2", "cudnn")
TABLE_PATH = pathlib.Path(__file__).parent / "data" / "kernels" / "attention_hopper.json"
TABLE: dict = json.loads(TABLE_PATH.read_text())
MEASURED_ARCHS = ("hopper",)


def fraction(kernel: str, rows: float, backward: bool = False) -> float:
    """`kernel`'s measured rate / dense bf16 peak for a call with `rows` = micro-batch x
    heads x sequence (module doc), forward or backward."""
    check_choice("attention kernel", kernel, KERNELS)
    check_number("rows", rows, strict=True)
    k = TABLE["kernels"][kernel]
    xs, ys = k["rows"], k["backward" if backward else "forward"]
    if rows <= xs[0]:
        return ys[0]
    if rows >= xs[-1]:
        return ys[-1]
    i = next(j for j in range(1, len(xs)) if xs[j] >= rows)
    t = (math.log(rows) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def measured(arch: str) -> bool:
    """Whether the table holds for GPUs of architecture `arch`."""
    return arch in MEASURED_ARCHS
