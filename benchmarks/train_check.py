"""What does train_check cost on top of the training it checks? (goals: at most 1.3x at
world 4; the live figure under 5% of the step time for 10 ms steps)

1. `tplab.train_check` of a 2-layer DropoutLM under the hand-written Megatron path with
   TP-aware clipping, at world size 4, against the same steps without it: on the ranks
   build, load the weights, parallelise and run the same training steps, nothing else.
   Alternated in one run; medians over the rounds (of the times, and of each round's
   ratio). The one-device runs are timed alone too: the reference (before the ranks
   start: they compare with it) and the reduction-order run for the band (in a thread of
   the notebook while the ranks train, tplab/checks/train.py).
2. The live figure: the rank side (one line printed per step) and the notebook side
   (parsing each rank's line, redrawing the figure every REDRAW_S as the Output widget
   would), per step of 10 ms, in CPU time.

3. `--fsdp`: the same on a 2-D run, FSDP2 x TP (`tplab.fsdp.fsdp_tp`: the hand-written TP
   above on mesh["tp"], then fully_shard per block and on the root over mesh["dp"]), dp=2
   at world 4, against the bare 2-D training (each replica on its slice of the batch).

    .venv/bin/python benchmarks/train_check.py [--steps 50] [--rounds 3] [--world 4] [--fsdp]
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import statistics
import sys
import time

import torch

import tplab
from tplab import fsdp, megatron, models, rng
from tplab.checks import train as training_check
from tplab.checks.train_live import LiveTraining
from tplab.rank.train_step import LIVE_PREFIX, LIVE_SUFFIX
from tplab.training import lm, steps

CFG = models.Config(vocab_size=32, dim=32, n_layers=2, n_heads=4, hidden_dim=64, seq_len=8,
                    batch_size=8)
BUILD = functools.partial(lm.DropoutLM, CFG, 0.1)
PLAN = functools.partial(rng.parallelize, plan=megatron.parallelize, seed=1234)
STEP = functools.partial(steps.lm_step, max_norm=1.0)
BATCHES = lm.counting_batches(CFG)
FSDP_PLAN = fsdp.fsdp_tp(PLAN, per_module=("Block",))


def bare_training(build, state, plan, make_batch, n, step, dp=1):
    """Rank side: the training train_check checks, and nothing else (dp > 1: a (dp, tp)
    mesh, each replica on its slice of every batch)."""
    world = torch.distributed.get_world_size()
    mesh = tplab.make_mesh() if dp == 1 else tplab.make_mesh(dp=dp, tp=world // dp)
    model = build()
    model.load_state_dict(state)
    model = plan(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    d = mesh.get_local_rank("dp") if dp > 1 else 0
    for i in range(n):
        step(model, optimizer, make_batch(i).chunk(dp)[d])


def end_to_end(lab, n: int, rounds: int, plan=PLAN, dp: int = 1) -> None:
    state = BUILD().state_dict()
    bare, checked, reference = [], [], []
    kw = {"dp": dp} if dp > 1 else {}
    training_check.train_check(lab, BUILD, plan, BATCHES, steps=2, step=STEP, live=False, **kw)
    for _ in range(rounds):
        t = time.perf_counter()
        lab.run(bare_training, BUILD, state, plan, BATCHES, n, STEP, dp)
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        report = training_check.train_check(lab, BUILD, plan, BATCHES, steps=n, step=STEP,
                                            live=False, **kw)
        checked.append(time.perf_counter() - t)
        assert report.ok, report
        t = time.perf_counter()
        with training_check.reference_threads(lab):
            for _ in range(2):  # the reference and the reduction-order run
                training_check.run_reference(BUILD(), BATCHES, n, STEP, None, None)
        reference.append(time.perf_counter() - t)
    b, c, r = (statistics.median(v) for v in (bare, checked, reference))
    ratio = statistics.median(x / y for x, y in zip(checked, bare, strict=True))
    what = f"FSDP2 x TP (dp={dp})" if dp > 1 else "TP"
    print(f"{what}: {n} steps at world {lab.world_size}, medians of {rounds} rounds: bare "
          f"{b:.2f} s, "
          f"train_check {c:.2f} s -> ratio {c / b:.2f}x; median of the rounds' ratios "
          f"{ratio:.2f}x (goal <= 1.3x)")
    print(f"  the two one-device runs alone: {r:.2f} s ({r / b:.2f}x the bare training); "
          f"one runs before the ranks, the band's run alongside them")


def live_cost(n: int, world: int, step_s: float = 0.010) -> None:
    # rank side: the line each rank prints per step
    out, real = io.StringIO(), sys.stdout
    from tplab.rank.train_step import emit_live as emit

    sys.stdout = out
    t = time.process_time()
    for i in range(n):
        emit(i + 1, torch.tensor(2.0), {"w": torch.tensor(1e-6)}, 0)
    rank_s = (time.process_time() - t) / n
    sys.stdout = real
    # notebook side: every rank's line, a redraw every REDRAW_S as in JupyterLab
    band = {"param": [1e-5] * (n + 1)}
    view = LiveTraining(world, torch.full((n,), 2.0), band, widget=False)
    spent = 0.0
    for i in range(n):
        lines = [f"{LIVE_PREFIX}{json.dumps({'rank': r, 'step': i + 1, 'loss': 2.0, 'diff': 1e-6})}"
                 f"{LIVE_SUFFIX}" for r in range(world)]
        t = time.process_time()
        before = view.updates
        for r, line in enumerate(lines):
            view.take(r, line)
        if view.updates != before:
            json.dumps(view.bundle())  # what the Output widget sends to the page
        spent += time.process_time() - t
        time.sleep(step_s)
    book_s = spent / n
    print(f"live figure, per step of {step_s * 1e3:.0f} ms: rank side {rank_s * 1e6:.0f} us "
          f"({rank_s / step_s:.1%}), notebook side {book_s * 1e3:.2f} ms CPU "
          f"({book_s / step_s:.1%}; {view.updates} redraws in {n} steps) (goal < 5%)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--fsdp", action="store_true",
                        help="also a 2-D FSDP2 x TP run (dp=2), against its bare training")
    args = parser.parse_args()
    live_cost(300, args.world)
    with tplab.launch(args.world) as lab:
        end_to_end(lab, args.steps, args.rounds)
        if args.fsdp:
            end_to_end(lab, args.steps, args.rounds, FSDP_PLAN, dp=2)


if __name__ == "__main__":
    main()
