"""How much does `tplab.trace()` slow a tensor-parallel step down? (goal: at most 1.3x)

A DTensor transformer-block step (forward and backward) at world size 4, traced and
untraced, alternated in one run so that both see the same machine load; each rank times its
own steps. With more ranks than cores the wall-time ratio is mostly scheduling noise, so the
main thread's CPU time per step (the trace's own cost) is printed too. Also: the DTensor MLP
step against the hand-written Megatron MLP step (a fact for the notebooks, not a goal).

    .venv/bin/python benchmarks/trace_overhead.py              # real rank processes
    .venv/bin/python benchmarks/trace_overhead.py --simulate   # tplab.simulate, one process
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed_steps(kind: str, sequence_parallel: bool, repeats: int) -> dict:
    """Rank side: build, then alternate untraced and traced steps; seconds per step (wall,
    and main-thread CPU under "<label> cpu")."""
    import torch

    import tplab
    from tplab import megatron, models, plans
    from tplab.mesh import make_mesh

    torch.set_num_threads(1)  # four ranks share the cores
    cfg = models.Config(dim=64, hidden_dim=256, n_heads=4, seq_len=32, batch_size=4)
    mesh = make_mesh()
    if kind == "block":
        model = tplab.apply_plan(models.Block(cfg), mesh, plans.block(sequence_parallel))
    elif kind == "mlp":
        model = tplab.apply_plan(models.MLP(cfg), mesh, plans.mlp())
    else:
        model = megatron.parallelize(models.MLP(cfg), mesh)
    x = models.make_input(cfg).requires_grad_()

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.pow(2).sum().backward()

    times: dict[str, list[float]] = {"plain": [], "traced": [], "plain cpu": [],
                                     "traced cpu": []}
    for i in range(repeats + 2):  # the first two rounds warm up
        for label in ("plain", "traced") if i % 2 else ("traced", "plain"):
            start, cpu = time.perf_counter(), time.thread_time()
            if label == "traced":
                with tplab.trace():
                    step()
            else:
                step()
            if i >= 2:
                times[label].append(time.perf_counter() - start)
                times[f"{label} cpu"].append(time.thread_time() - cpu)
    return times


def slowest_rank(per_rank: list[dict]) -> dict:
    """Per step, the slowest rank's time: a TP step ends when its last rank does."""
    return {label: [max(ts) for ts in zip(*(r[label] for r in per_rank), strict=True)]
            for label in per_rank[0]}


def main() -> None:
    import tplab

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="use tplab.simulate(4)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    lab = tplab.simulate(4) if args.simulate else tplab.launch(4)
    mode = "simulate(4)" if args.simulate else f"launch(4), {lab.backend}"
    print(f"{mode}: medians of {args.repeats} steps each, slowest rank per step")
    try:
        med = {}
        for name, kind, sp in [("block", "block", False), ("block, sequence parallel", "block",
                                                            True),
                               ("DTensor MLP", "mlp", False), ("Megatron MLP", "megatron",
                                                               False)]:
            per_rank = lab.run(timed_steps, kind, sp, args.repeats)
            times = slowest_rank(per_rank)
            cpu = statistics.median(statistics.median(r["traced cpu"]) -
                                    statistics.median(r["plain cpu"]) for r in per_rank)
            plain = statistics.median(times["plain"])
            traced = statistics.median(times["traced"])
            # each traced step against the untraced one next to it: robust to load drifts
            paired = statistics.median(t / p for t, p in zip(times["traced"], times["plain"],
                                                             strict=True))
            med[name] = plain
            print(f"{name:26s} untraced {plain * 1e3:7.2f} ms  traced {traced * 1e3:7.2f} ms  "
                  f"ratio of medians {traced / plain:.2f}x  median ratio {paired:.2f}x  "
                  f"CPU +{cpu * 1e3:.2f} ms")
        print(f"DTensor MLP step / Megatron MLP step: "
              f"{med['DTensor MLP'] / med['Megatron MLP']:.2f}x "
              f"({med['DTensor MLP'] * 1e3:.2f} ms vs {med['Megatron MLP'] * 1e3:.2f} ms)")
    finally:
        lab.shutdown()


if __name__ == "__main__":
    main()
