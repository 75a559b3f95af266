"""How fast one GEMM runs for its shape: a roofline with tile and wave quantisation.

NVIDIA's "Matrix Multiplication Background User's Guide" (Deep Learning Performance
documentation) gives the three effects used here, for C (m x n) = A (m x k) B (k x n):

- **arithmetic intensity**: 2mnk FLOPs over d (mk + kn + mn) bytes; below the GPU's ridge
  point (peak FLOP/s over memory bandwidth) the GEMM is memory-bound and runs at
  intensity / ridge of its compute-bound rate;
- **tile quantisation**: the output is computed in tiles (128 x 256 and 128 x 128 are
  cuBLAS's usual bf16 tiles on A100/H100); a dimension that is not a multiple of the tile
  pays for the whole last tile;
- **wave quantisation**: tiles run one per SM at a time, in waves of `sms`; a last,
  partial wave leaves SMs idle.

`gemm_efficiency` is the product: the fraction of a large, well-shaped GEMM's rate this
shape reaches, taking the better of the two tiles (as cuBLAS's heuristics pick one). It
does not model split-K, stream-K or small-k pipeline fill, which make small GEMMs somewhat
faster or slower than this; it cannot be checked here (no GPU).
"""

from __future__ import annotations

import math

from tplab.cost.hardware import Hardware
from tplab.cost.validate import check_int, check_type

TILES = ((128, 256), (128, 128))


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware, dtype_bytes: int = 2) -> float:
    """Fraction (0, 1] of a large GEMM's rate that an (m x k) @ (k x n) GEMM reaches on
    `hw` (see the module doc)."""
    for name, value in (("m", m), ("n", n), ("k", k), ("dtype_bytes", dtype_bytes)):
        check_int(name, value)
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    quantised = 0.0
    for tm, tn in TILES:
        for a, b in ((m, n), (n, m)):   # either orientation of the tile
            tiles = math.ceil(a / tm) * math.ceil(b / tn)
            waves = math.ceil(tiles / hw.sms)
            quantised = max(quantised, a * b / (waves * hw.sms * tm * tn))
    intensity = 2 * m * n * k / (dtype_bytes * (m * k + k * n + m * n))
    ridge = hw.flops / hw.memory_bandwidth
    return quantised * min(1.0, intensity / ridge)


def linear_gemms(tokens: int, d_in: int, d_out: int) -> list[tuple[int, int, int]]:
    """The three GEMMs of a linear layer y = x W^T with x (tokens, d_in): forward
    (tokens, d_out, d_in), input gradient (tokens, d_in, d_out), weight gradient
    (d_out, d_in, tokens), as (m, n, k)."""
    return [(tokens, d_out, d_in), (tokens, d_in, d_out), (d_out, d_in, tokens)]
