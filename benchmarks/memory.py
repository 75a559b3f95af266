"""What does `tplab.memory()` cost, and how far is the memory model from what it measures?

1. Overhead (goal: at most 1.2x): a DTensor transformer-block step (forward and backward)
   at world size 4, measured and not, alternated in one run so that both see the same
   machine load; each rank times its own steps, a step ends with its slowest rank, and the
   ratio is the median of each measured step over the plain step next to it. The main
   thread's CPU time per step is printed too, and its ratio (with more ranks than cores the
   wall time is mostly scheduling).
2. Model error (goal: 0 bytes): `tplab.cost.lab_memory` against `tplab.memory` for the
   lab's MLP and Block under both plans, with and without SP, on the same ranks: the
   largest difference over every number (parameters, gradients, Adam state, activations,
   peak, and each module's bytes).

    .venv/bin/python benchmarks/memory.py              # real rank processes
    .venv/bin/python benchmarks/memory.py --simulate   # tplab.simulate, one process
"""

from __future__ import annotations

import argparse
import statistics
import time

CASES = [("mlp", "megatron", False), ("mlp", "megatron", True), ("mlp", "dtensor", False),
         ("block", "megatron", False), ("block", "megatron", True),
         ("block", "dtensor", False), ("block", "dtensor", True)]


def timed_steps(sequence_parallel: bool, repeats: int) -> dict:
    """Rank side: alternate plain and measured block steps; seconds per step (wall, and
    main-thread CPU under "<label> cpu")."""
    import torch

    import tplab
    from tplab import models, plans

    torch.set_num_threads(1)  # four ranks share the cores
    cfg = models.Config(dim=64, hidden_dim=256, n_heads=4, seq_len=32, batch_size=4)
    model = tplab.apply_plan(models.Block(cfg), tplab.make_mesh(), plans.block(sequence_parallel))
    x = models.make_input(cfg).requires_grad_()

    def step():
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()

    times: dict[str, list[float]] = {"plain": [], "measured": [], "plain cpu": [],
                                     "measured cpu": []}
    for i in range(repeats + 2):  # the first two rounds warm up
        for label in ("plain", "measured") if i % 2 else ("measured", "plain"):
            start, cpu = time.perf_counter(), time.thread_time()
            if label == "measured":
                with tplab.memory():
                    step()
            else:
                step()
            if i >= 2:
                times[label].append(time.perf_counter() - start)
                times[f"{label} cpu"].append(time.thread_time() - cpu)
    return times


def measured_steps(cases, cfg) -> dict:
    """Rank side: tplab.memory's summary of one step of each case."""
    import torch

    import tplab
    from tplab import megatron, models, plans

    mesh = tplab.make_mesh(tp=torch.distributed.get_world_size())
    out = {}
    for kind, plan, sp in cases:
        model = (models.MLP if kind == "mlp" else models.Block)(cfg)
        if plan == "megatron":
            model = megatron.parallelize(model, mesh, sequence_parallel=sp)
        else:
            model = tplab.apply_plan(model, mesh, plans.mlp() if kind == "mlp" else
                                     plans.block(sp))
        x = models.make_input(cfg).requires_grad_()
        with tplab.memory() as m:
            model(x).sum().backward()
        out[(kind, plan, sp)] = m.summary()
    return out


def model_error(per_rank: list[dict], cfg, world_size: int) -> tuple[int, int, int]:
    """(largest |model - measured| in bytes, numbers compared, activation bytes compared)."""
    from tplab.cost.lab_models import lab_memory

    worst = compared = activations = 0
    for case in CASES:
        predicted = lab_memory(case[0], cfg, world_size, case[2])
        for result in per_rank:
            m = result[case]
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                        "peak_bytes"):
                worst = max(worst, abs(m[key] - predicted[key]))
                compared += 1
            rows = {r["module"]: r["bytes"] for r in m["rows"]}
            for row in predicted["rows"]:
                worst = max(worst, abs(rows.pop(row["module"], 0) - row["bytes"]))
                compared += 1
            worst = max([worst, *rows.values()])   # a module the model does not know
            activations += m["activation_bytes"]
    return worst, compared, activations


def main() -> None:
    import tplab
    from tplab import models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="use tplab.simulate(4)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    lab = tplab.simulate(4) if args.simulate else tplab.launch(4)
    mode = "simulate(4)" if args.simulate else f"launch(4), {lab.backend}"
    print(f"{mode}: medians of {args.repeats} steps each, slowest rank per step")
    try:
        for name, sp in (("block", False), ("block, sequence parallel", True)):
            per_rank = lab.run(timed_steps, sp, args.repeats)
            times = {label: [max(ts) for ts in zip(*(r[label] for r in per_rank), strict=True)]
                     for label in per_rank[0]}
            plain, measured = (statistics.median(times[k]) for k in ("plain", "measured"))
            paired = statistics.median(m / p for m, p in zip(times["measured"], times["plain"],
                                                             strict=True))
            cpu = statistics.median(statistics.median(r["measured cpu"]) -
                                    statistics.median(r["plain cpu"]) for r in per_rank)
            cpu_ratio = statistics.median(  # each rank's own CPU time: no scheduling noise
                statistics.median(m / p for m, p in zip(r["measured cpu"], r["plain cpu"],
                                                        strict=True)) for r in per_rank)
            verdict = "meets" if paired <= 1.2 else "misses"
            print(f"{name:26s} plain {plain * 1e3:7.2f} ms  measured {measured * 1e3:7.2f} ms  "
                  f"median ratio {paired:.2f}x ({verdict} the 1.2x goal)  CPU +{cpu * 1e3:.2f} "
                  f"ms, CPU ratio {cpu_ratio:.2f}x")
        cfg = models.Config(dim=48, hidden_dim=96, seq_len=12, batch_size=3)
        worst, compared, activations = model_error(lab.run(measured_steps, CASES, cfg), cfg,
                                                   lab.world_size)
        print(f"model error at world 4: {worst} bytes at most, over {compared} numbers "
              f"({len(CASES)} cases x 4 ranks, {activations} activation bytes; goal 0)")
        for world in (1, 2):
            per_rank = tplab.simulate(world).run(measured_steps, CASES, cfg)
            worst, compared, _ = model_error(per_rank, cfg, world)
            print(f"model error at world {world} (simulated): {worst} bytes at most, over "
                  f"{compared} numbers")
    finally:
        lab.shutdown()


if __name__ == "__main__":
    main()
