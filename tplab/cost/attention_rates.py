"""Flash attention's rate by kernel and shape, measured (issue 35): the rate a run's attention
kernel reaches depends on which kernel its stack runs and on how much work one call has.

On one H200 (benchmarks/gpu_layer.py; the table is data/kernels/attention_hopper.json,
written by benchmarks/attention_table.py from benchmarks/results/gpu-layer-2026-12-04.json),
causal bf16 attention with heads of width 128:

- torch's FlashAttention-2 backend ("fa2") reaches 0.35 of the dense bf16 peak forward and
  0.31 backward on large calls, the 0.35 `Hardware.attention_efficiency` held for every
  Hopper shape, but about 0.22 with 8 heads at 8192 tokens and 0.11 with 2;
- cuDNN's fused attention ("cudnn", the kernel class Transformer Engine runs on Hopper)
  reaches 0.61-0.67 forward and 0.55 backward on large calls, 1.5-2.2 x FA2, falling
  likewise on small ones.

The kernels' grid holds one CTA per 128 query rows of one head, and each CTA's work grows
with the sequence: the rate depends on micro-batch x query heads on the rank and on the
rank's sequence, each on its own (at 65,536 rows of work, b h s, cuDNN's forward runs at
0.31 of peak with s = 2048 and 0.56 with s = 32768). `fraction` interpolates the measured
medians linearly in log (b h) at each measured sequence, then in log sequence, and holds
the ends. Measured on the
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


def _along(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, linear in log x between the measured points, held past the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = next(j for j in range(1, len(xs)) if xs[j] >= x)
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def fraction(kernel: str, batch_heads: float, seq: float, backward: bool = False) -> float:
    """`kernel`'s measured rate / dense bf16 peak for a call of `batch_heads` = micro-batch x
    query heads on the rank over a sequence of `seq` (module doc), forward or backward: at
    each of the two measured sequences around `seq`, interpolated in log (batch x heads);
    then between them in log sequence."""
    check_choice("attention kernel", kernel, KERNELS)
    check_number("batch_heads", batch_heads, strict=True)
    check_number("seq", seq, strict=True)
    k = TABLE["kernels"][kernel]
    part = "backward" if backward else "forward"
    at = [_along(k["by_seq"][str(s)]["batch_heads"], k["by_seq"][str(s)][part], batch_heads)
          for s in k["seqs"]]
    return _along(k["seqs"], at, seq)


def measured(arch: str) -> bool:
    """Whether the table holds for GPUs of architecture `arch`."""
    return arch in MEASURED_ARCHS
