"""Shutdown of a lab (tplab's kill_trees), against psutil.wait_procs in the same run.

    python benchmarks/shutdown.py [--world-size 2] [--repeats 5]

Each repeat launches a lab, runs one cell, and times `lab.shutdown()`, alternately with
tplab's own wait (a process counts as ended once it is dead: gone or a zombie) and with the
baseline, psutil.wait_procs on the same processes, which also waits for whoever inherits a
killed fork server's ranks to reap them. Prints medians and the ratio tplab / baseline.
Goal: <= 0.2x (a lab restart is a shutdown then a launch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil

import tplab
from tplab.lab import processes

OWN = processes.kill_trees


def baseline(pids, timeout: float = 5.0) -> list[int]:
    """kill_trees as it was: SIGKILL the same processes, then psutil.wait_procs."""
    procs = [psutil.Process(p) for p in processes.tree(pids) if psutil.pid_exists(p)]
    OWN(pids, timeout=0)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive]


def timed_shutdown(world_size: int, kill) -> float:
    lab = tplab.launch(world_size)
    lab.run(lambda: 1)
    processes.kill_trees = kill
    try:
        started = time.perf_counter()
        lab.shutdown()
        return time.perf_counter() - started
    finally:
        processes.kill_trees = OWN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"tplab": [], "baseline": []}
    for _ in range(args.repeats):
        times["tplab"].append(timed_shutdown(args.world_size, OWN))
        times["baseline"].append(timed_shutdown(args.world_size, baseline))
    own, base = (statistics.median(times[k]) for k in ("tplab", "baseline"))
    print(f"lab.shutdown() at world {args.world_size}, median of {args.repeats}: "
          f"tplab {own:.3f} s, baseline (psutil.wait_procs) {base:.3f} s, "
          f"ratio {own / base:.2f}x (goal <= 0.2x)")


if __name__ == "__main__":
    main()
