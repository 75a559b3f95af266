"""Measure this machine's collectives and fit alpha and beta to them.

`calibrate(lab)` times gloo collectives on the lab's own ranks (barrier, then a timed call,
repeated; per call the rank that left the barrier last counts, then the median), fits
t = a + b x per op by least squares, where x is the op's bytes factor from
`tplab.cost.collectives` (2 nbytes (N-1)/N for all_reduce, nbytes (N-1)/N for the others),
and checks the fit on message sizes it held out. alpha = a / ring steps, bandwidth = 1 / b.
The fit minimises relative error (each point weighted by 1/t), so small messages count as
much as large ones.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from tplab.core import ops
from tplab.cost.collectives import collective_terms
from tplab.cost.hardware import Hardware, Link
from tplab.errors import LabError
from tplab.lab.contract import Ranks

KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = tuple(KiB * 2**k for k in range(15))   # 1 KiB .. 16 MiB
DEFAULT_OPS = ops.TP_OPS


def _bytes_factor(op: str, nbytes: float, n: int) -> tuple[int, float]:
    """(ring steps, x) for op: the model's latency steps and its bytes term at B = 1."""
    latency, x = collective_terms(op, nbytes, n, Link("unit", 1.0, 1.0))
    return round(latency), x


def fit_line(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least squares t = a + b x with weights 1/t (relative error); a, b kept >= 0."""
    x, t = np.asarray(xs, float), np.asarray(ts, float)
    design = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if a < 0:   # no negative latency: refit through the origin
        a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return float(a), max(float(b), 1e-15)


@dataclass
class Calibration:
    """What `calibrate` measured and fitted. `rows`: one dict per (op, bytes) with the
    median `measured_s`, the fit's `predicted_s`, `rel_error` and whether it was `fitted`
    (False: held out, a true test of the model)."""

    world_size: int
    backend: str
    flops: float
    fits: dict[str, dict] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)

    @property
    def link(self) -> Link:
        """The ranks' wire, with the fitted (alpha, bandwidth) of each op."""
        per_op = {op: (f["alpha"], f["bandwidth"]) for op, f in self.fits.items()}
        alpha = statistics.median(a for a, _ in per_op.values())
        bandwidth = statistics.median(b for _, b in per_op.values())
        return Link(f"{self.backend} on this machine", bandwidth, alpha, per_op)

    @property
    def hardware(self) -> Hardware:
        """"this machine" as a preset: every rank in one node, matmuls at the measured rate."""
        return Hardware("this machine", self.flops, self.link, self.link, self.world_size)

    def held_out(self, min_bytes: int = 0) -> list[dict]:
        return [r for r in self.rows if not r["fitted"] and r["bytes"] >= min_bytes]

    def median_error(self, min_bytes: int = 64 * KiB) -> float:
        """Median relative error of the prediction on held-out sizes of `min_bytes` and up."""
        return statistics.median(r["rel_error"] for r in self.held_out(min_bytes))


def _check_real(lab: Ranks) -> None:
    if lab.in_process:
        raise LabError("calibrate needs real rank processes (tplab.launch): the simulated "
                       "lab's fake process group moves no bytes, so there is nothing to time")


def calibrate(lab: Ranks, sizes=DEFAULT_SIZES, ops=DEFAULT_OPS, repeats: int = 7,
              warmup: int = 2, holdout: int = 2, matmul_n: int = 512) -> Calibration:
    """Time `ops` on the lab's ranks at each of `sizes` (bytes), fit alpha and beta per op
    on all but every `holdout`-th size (from the second; 0 holds out nothing), and report
    how well the fit predicts the sizes it did not see. Raises LabError on a simulated lab.
    """
    _check_real(lab)
    sizes = sorted(sizes)
    # deferred: `tplab.cost` is arithmetic and loads no torch (0.15 s, with torch 2.2-2.7 s:
    # python -X importtime -c 'import tplab.cost'); the ranks' half needs torch
    from tplab.rank.calibrate_step import rank_timings

    results = lab.run(rank_timings, tuple(ops), tuple(sizes), repeats, warmup, matmul_n)
    n = lab.world_size
    held = set(sizes[1::holdout]) if holdout else set()
    cal = Calibration(n, results[0]["backend"],
                      statistics.median(r["flops"] for r in results))
    for op in ops:
        points = []   # (size, nbytes, x, seconds)
        for size in sizes:
            nbytes = results[0]["timings"][(op, size)][0]
            # Per call, the rank that left the barrier last measures the collective alone
            # (the others also wait for it): the model assumes all ranks start together.
            calls = zip(*(r["timings"][(op, size)][1] for r in results), strict=True)
            t = statistics.median(min(c) for c in calls)
            points.append((size, nbytes, _bytes_factor(op, nbytes, n)[1], t))
        a, slope = fit_line([x for s, _, x, _ in points if s not in held],
                        [t for s, _, _, t in points if s not in held])
        steps = _bytes_factor(op, 1, n)[0]
        cal.fits[op] = {"alpha": a / steps, "bandwidth": 1 / slope, "latency_s": a}
        for size, nbytes, x, t in points:
            pred = a + slope * x
            cal.rows.append({"op": op, "bytes": nbytes, "measured_s": t, "predicted_s": pred,
                             "rel_error": abs(pred - t) / t, "fitted": size not in held})
    return cal
