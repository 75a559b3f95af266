"""What a local rank really holds: PSS (proportional set size: a page shared by k processes
counts 1/k to each) of every rank, with the fork server and without it (fork=False).

    python benchmarks/rank_memory.py [--world-sizes 4 16]

The figures set tplab.lab.arguments.RANK_MEMORY_GIB, which caps world_size for local ranks
(with the fork server the ranks share torch's pages, so PSS is far below RSS).
"""

from __future__ import annotations

import argparse
import statistics

import psutil

import tplab


def pss_mib(pids) -> list[float]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid).memory_full_info().pss / 2**20)
        except psutil.Error:
            continue
    return out


def warm():
    """A DTensor MLP step, so that the rank has touched what a lesson touches."""
    import torch

    n = torch.distributed.get_world_size()
    cfg = tplab.models.Config(dim=64, hidden_dim=64 * n)
    mesh = tplab.make_mesh(tp=n)
    model = tplab.apply_plan(tplab.models.MLP(cfg), mesh, tplab.plans.mlp())
    model(tplab.models.make_input(cfg)).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    for n in args.world_sizes:
        for fork in (True, False):
            with tplab.launch(n, fork=fork) as lab:
                lab.run(warm)
                pss = pss_mib(lab.rank_pids)
                rss = [psutil.Process(p).memory_info().rss / 2**20 for p in lab.rank_pids]
                others = [p for p in lab.pids if p not in lab.rank_pids]
                print(f"world {n:>2}, {'fork server' if fork else 'fork=False '}: PSS per rank "
                      f"median {statistics.median(pss):.0f} MiB (max {max(pss):.0f}), RSS "
                      f"{statistics.median(rss):.0f} MiB; other lab processes "
                      f"{sum(pss_mib(others)):.0f} MiB in all")


if __name__ == "__main__":
    main()
