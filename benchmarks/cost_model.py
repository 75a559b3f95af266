"""How well does the cost model predict collectives?

Two parts:

1. Published nccl-tests results (benchmarks/data/nccl_tests_allreduce.csv, each row with its
   source): tplab.cost's NCCL model (NCCL 2.21.5's tuning model, `tplab.cost.nccl`) gives
   the all-reduce bus bandwidth at the same system, GPU count and size; the error is
   printed per point, and the algorithm / protocol NCCL was seen to choose
   (benchmarks/data/nccl_tests_choices.csv) is compared with the model's choice. No GPU is
   needed: the references are published numbers.
2. This machine (`--calibrate`): starts a lab, runs `tplab.cost.calibrate` over message sizes
   from 1 KiB to 16 MiB (every other size held out of the fit), and prints the fit per op
   and, for the held-out sizes, predicted against measured time. The goal: a median error
   within 30% for 64 KiB and up.

    .venv/bin/python benchmarks/cost_model.py [--calibrate] [--world-size 2] [--repeats 9]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import tplab
from tplab import cost
from tplab.cost import calibrate
from tplab.cost.calibrate import KiB

GOAL = 0.30
DATA = Path(__file__).parent / "data"


def rows(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def machine(r: dict):
    hw = cost.HARDWARE[r["system"]]
    return hw.with_(gpus_per_node=max(int(r["gpus_per_node"]), 1),
                    nics_per_node=int(r["nics_per_node"]))


def published() -> None:
    print("All-reduce bus bandwidth: tplab.cost (NCCL 2.21.5's model) against published "
          "nccl-tests results\n")
    print(f"{'system':<10}{'GPUs':>5}{'alg':>6}{'bytes':>12}{'published':>11}{'model':>8}"
          f"{'error':>8}  {'model took':<17}kind")
    errors = []
    for r in rows("nccl_tests_allreduce.csv"):
        hw = machine(r)
        n = int(r["nodes"]) * int(r["gpus_per_node"])
        nbytes = int(r["bytes"])
        p = cost.collective_plan("all_reduce", nbytes, n, hw, r["algorithm"])
        ref, got = float(r["busbw_GBps"]), p["bus_bandwidth"] / 1e9
        err = (got - ref) / ref
        if r["kind"] == "measured":
            errors.append(abs(err))
        print(f"{r['system']:<10}{n:>5}{r['algorithm']:>6}{nbytes:>12}{ref:>11.4g}"
              f"{got:>8.4g}{err:>+8.0%}  {p['algorithm'] + '/' + p['protocol']:<17}"
              f"{r['kind']}")
    print(f"\nmedian |error| over the measured points: {statistics.median(errors):.0%} "
          f"({len(errors)} points; input, fitted and cap rows are shown, not counted)")

    print("\nNCCL's choice of algorithm / protocol, as a run reported it, against the model's:")
    agree = total = 0
    for r in rows("nccl_tests_choices.csv"):
        hw, n = cost.HARDWARE[r["system"]], int(r["gpus"])
        size = int(r["min_bytes"])
        while size <= int(r["max_bytes"]):
            p = cost.collective_plan("all_reduce", size, n, hw, "auto")
            ok = (p["algorithm"], p["protocol"]) == (r["algorithm"], r["protocol"])
            agree, total = agree + ok, total + 1
            if not ok:
                print(f"  {size:>12} B: published {r['algorithm']}/{r['protocol']}, "
                      f"model {p['algorithm']}/{p['protocol']}")
            size *= 2
    print(f"  the model agrees at {agree} of {total} sizes (8 B to 16 GiB, powers of two)")


def on_this_machine(world_size: int, repeats: int) -> None:
    with tplab.launch(world_size) as lab:
        start = time.perf_counter()
        cal = calibrate(lab, repeats=repeats)
        took = time.perf_counter() - start

    print(f"\ncalibrate: {world_size} ranks, {cal.backend}, {repeats} calls per point, "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="store_true",
                        help="also calibrate the model on this machine's ranks")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    published()
    if args.calibrate:
        on_this_machine(args.world_size, args.repeats)


if __name__ == "__main__":
    main()
