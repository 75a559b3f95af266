"""Rank side of `tplab.cost.calibrate` (tplab/cost/calibrate.py): time each collective at
each size on this rank, and a matmul, for the fit the notebook makes."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def rank_timings(ops, sizes, repeats, warmup, matmul_n):
    """{(op, size): (nbytes timed, [seconds per call])}, matmul FLOP/s."""
    n = dist.get_world_size()
    # torch 2.13 renamed the tensor forms (the old names warn on every call)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def make(op, numel):
        x = torch.ones(numel)
        if op == "all_reduce":
            return lambda: dist.all_reduce(x)
        if op == "all_gather":   # nbytes is the gathered output
            shard, out = torch.ones(numel // n), torch.empty(numel)
            return lambda: all_gather(out, shard)
        if op == "reduce_scatter":   # nbytes is the input
            out = torch.empty(numel // n)
            return lambda: reduce_scatter(out, x)
        if op == "all_to_all":
            out = torch.empty(numel)
            return lambda: dist.all_to_all_single(out, x)
        raise ValueError(f"calibrate cannot time {op!r}")

    calls = {}
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4 // n * n)   # float32, divisible by the group
            calls[(op, size)] = (numel * 4, make(op, numel))
            for _ in range(warmup):
                calls[(op, size)][1]()
    timings = {key: (nbytes, []) for key, (nbytes, _) in calls.items()}
    # Rounds over every (op, size): a burst of load from elsewhere then spreads over all
    # sizes instead of spoiling every call of one of them.
    for _ in range(repeats):
        for key, (_, call) in calls.items():
            dist.barrier()
            start = time.perf_counter()
            call()
            timings[key][1].append(time.perf_counter() - start)
    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    a @ b
    dist.barrier()   # all ranks multiply at once, as they would in a step
    start = time.perf_counter()
    for _ in range(8):
        a @ b
    flops = 8 * 2 * matmul_n**3 / (time.perf_counter() - start)
    return {"timings": timings, "flops": flops, "backend": dist.get_backend()}
