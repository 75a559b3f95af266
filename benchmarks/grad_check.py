"""What does grad_check cost on top of the work it has to do? (goals: 1.5x, and 1.3x for
tracing with causes)

1. `grad_check` on a 2-layer TinyLM (tplab.plans.lm(): vocab-parallel embedding, every
   block, loss-parallel head) at world size 4, against the bare work done by hand: the
   reference forward and backward here, and on the ranks build, load the weights,
   parallelise, forward and backward. The difference is what grad_check adds: bringing
   every gradient back, pairing, assembling and comparing. Alternated in one run.
2. Tracing with causes (`tplab.trace()`, every record's cause read from the stack) against
   no trace, on the DTensor block step of benchmarks/trace_overhead.py.

    .venv/bin/python benchmarks/grad_check.py              # real rank processes
    .venv/bin/python benchmarks/grad_check.py --simulate   # tplab.simulate(4)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_overhead import slowest_rank, timed_steps  # noqa: E402


def bare_step(build, state, plan, x, loss_fn):
    """Rank side: exactly the parallel work grad_check needs, and nothing else."""
    from torch.distributed.tensor.parallel import loss_parallel

    import tplab

    model = build()
    model.load_state_dict(state)
    model = tplab.apply_plan(model, tplab.make_mesh(), plan)
    with loss_parallel():
        loss = loss_fn(model(x), x)
        loss.backward()
    return None


def bare(lab, build, plan, make_input, loss_fn):
    model = build()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = make_input()
    loss_fn(model(x), x).backward()
    lab.run(bare_step, build, state, plan, x, loss_fn)


def main() -> None:
    import tplab
    from tplab import models, plans

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="use tplab.simulate(4)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cfg = models.Config(vocab_size=256, dim=64, hidden_dim=256, n_layers=2, n_heads=4,
                        seq_len=32, batch_size=4)
    build = functools.partial(models.TinyLM, cfg)
    make_input = functools.partial(models.make_tokens, cfg)
    plan = plans.lm()
    lab = tplab.simulate(4) if args.simulate else tplab.launch(4)
    mode = "simulate(4)" if args.simulate else f"launch(4), {lab.backend}"
    try:
        times: dict[str, list[float]] = {"grad_check": [], "bare": []}
        for i in range(args.repeats + 1):  # the first round warms up
            for label in ("grad_check", "bare") if i % 2 else ("bare", "grad_check"):
                start = time.perf_counter()
                if label == "bare":
                    bare(lab, build, plan, make_input, models.lm_loss)
                else:
                    report = tplab.grad_check(lab, build, plan, make_input, models.lm_loss)
                    assert report.ok, report.summary()
                if i:
                    times[label].append(time.perf_counter() - start)
        check, work = (statistics.median(times[k]) for k in ("grad_check", "bare"))
        paired = statistics.median(c / b for c, b in zip(times["grad_check"], times["bare"],
                                                         strict=True))
        print(f"{mode}: medians of {args.repeats} runs each")
        print(f"grad_check, 2-layer TinyLM    {check * 1e3:8.1f} ms   bare work "
              f"{work * 1e3:8.1f} ms   ratio {check / work:.2f}x (median of pairs "
              f"{paired:.2f}x; goal 1.5x)")
        per_rank = lab.run(timed_steps, "block", False, 30)
        steps = slowest_rank(per_rank)
        plain, traced = (statistics.median(steps[k]) for k in ("plain", "traced"))
        paired = statistics.median(t / p for t, p in zip(steps["traced"], steps["plain"],
                                                         strict=True))
        print(f"block step, traced with causes {traced * 1e3:7.2f} ms   untraced "
              f"{plain * 1e3:7.2f} ms   ratio {traced / plain:.2f}x (median of pairs "
              f"{paired:.2f}x; goal 1.3x)")
    finally:
        lab.shutdown()


if __name__ == "__main__":
    main()
