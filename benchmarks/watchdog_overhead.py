"""What the watchdog's "where is each rank" reports cost a TP step, measured in one run.

    python benchmarks/watchdog_overhead.py [--world-size 4] [--steps 30] [--rounds 5]

Each rank runs a tensor-parallel MLP step (ColwiseParallel then RowwiseParallel, forward
and backward) in one long cell, alternating rounds with its reporter thread on (a
snapshot of the rank's stack written to the store every 0.1 s) and off. Prints the median
step time of each and their ratio. Goal: watched / unwatched <= 1.1x.
"""

from __future__ import annotations

import argparse
import statistics

import tplab


def mlp_step_times(steps: int, rounds: int) -> dict[str, list[float]]:
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from tplab.rank.collectives import REPORT

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(32, 256, requires_grad=True)
    times: dict[str, list[float]] = {"watched": [], "unwatched": []}
    for i in range(2 * rounds):
        mode = "watched" if i % 2 == 0 else "unwatched"
        REPORT.reporting = mode == "watched"
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            model(x).sum().backward()
            times[mode].append(time.perf_counter() - t)
    REPORT.reporting = True
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tplab.launch(args.world_size, timeout=600) as lab:
        per_rank = lab.run(mlp_step_times, args.steps, args.rounds)
    watched = statistics.median(t for r in per_rank for t in r["watched"])
    unwatched = statistics.median(t for r in per_rank for t in r["unwatched"])
    print(f"world size {args.world_size}, {args.rounds} rounds x {args.steps} steps each, "
          f"medians over all ranks")
    print(f"TP MLP step: watched {watched * 1e3:.2f} ms, unwatched {unwatched * 1e3:.2f} ms, "
          f"ratio {watched / unwatched:.2f}x (goal <= 1.1x)")


if __name__ == "__main__":
    main()
