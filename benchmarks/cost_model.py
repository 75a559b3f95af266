"""How well does the alpha-beta model predict this machine's collectives?

Starts a lab, runs `tplab.cost.calibrate` over message sizes from 1 KiB to 16 MiB (every
other size held out of the fit), and prints the fit per op and, for the held-out sizes,
predicted against measured time. The goal: a median error within 30% for 64 KiB and up.

    .venv/bin/python benchmarks/cost_model.py [--world-size 2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import tplab
from tplab.cost import calibrate
from tplab.cost.calibrate import KiB

GOAL = 0.30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    with tplab.launch(args.world_size) as lab:
        start = time.perf_counter()
        cal = calibrate(lab, repeats=args.repeats)
        took = time.perf_counter() - start

    print(f"calibrate: {args.world_size} ranks, {cal.backend}, {args.repeats} calls per point, "
          f"{took:.1f} s; matmul {cal.flops / 1e9:.1f} GFLOP/s per rank")
    print(f"\n{'op':<15}{'alpha (us/step)':>16}{'bandwidth (GB/s)':>18}")
    for op, fit in cal.fits.items():
        print(f"{op:<15}{fit['alpha'] * 1e6:>16.1f}{fit['bandwidth'] / 1e9:>18.2f}")

    print(f"\nheld-out sizes (not fitted):\n{'op':<15}{'bytes':>10}{'measured ms':>13}"
          f"{'predicted ms':>14}{'error':>8}")
    for r in cal.held_out():
        print(f"{r['op']:<15}{r['bytes'] // KiB:>8}Ki{r['measured_s'] * 1e3:>13.3f}"
              f"{r['predicted_s'] * 1e3:>14.3f}{r['rel_error']:>8.0%}")

    for op in cal.fits:
        errors = [r["rel_error"] for r in cal.held_out(64 * KiB) if r["op"] == op]
        print(f"median error, {op}, held out, >= 64 KiB: {statistics.median(errors):.0%}")
    error = cal.median_error(64 * KiB)
    verdict = "within" if error <= GOAL else "OUTSIDE"
    print(f"\nmedian prediction error, held-out sizes >= 64 KiB: {error:.0%} "
          f"({verdict} the {GOAL:.0%} goal)")


if __name__ == "__main__":
    main()
