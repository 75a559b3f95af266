"""Print grad_check's and train_check's reports (rows, notes, verdicts) on the lessons'
models, correct and with the lessons' planted bugs, on `tplab.simulate(2)` and (2x2)
`simulate(4)`: a before/after comparison for changes that must not change behaviour
(issue 36 item 4). Run it on two commits and diff the outputs:

    scripts/env.sh python tests/scripts/check_reports.py > before.txt
    git checkout <other> && scripts/env.sh python tests/scripts/check_reports.py > after.txt
    diff before.txt after.txt

`--no-tolerance` leaves out the per-row tolerance column (which the relative tolerances of
issue 37 item 3 added), so that reports from before it compare with those after.
"""

from __future__ import annotations

import functools
import sys

import tplab
from tplab import megatron, models, plans

CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=4,
                    batch_size=4)
SP = functools.partial(megatron.parallelize, sequence_parallel=True)
MISSING_F = functools.partial(megatron.parallelize, reduce_grad=False)

GRAD_CASES = {
    "mlp-dtensor": (models.MLP, plans.mlp(), False),
    "mlp-megatron": (models.MLP, megatron.parallelize, False),
    "mlp-missing-f": (models.MLP, MISSING_F, False),
    "block-dtensor-sp": (models.Block, plans.block(sequence_parallel=True), False),
    "block-megatron-sp": (models.Block, SP, False),
    "lm-dtensor": (models.TinyLM, plans.lm(), True),
    "lm-megatron": (models.TinyLM, megatron.parallelize, True),
    "lm-missing-f": (models.TinyLM, MISSING_F, True),
}


def row_line(r: dict, tolerance: bool) -> str:
    cells = [r["name"], r["kind"], r.get("pair", ""), f"{r['max_abs']:.3e}",
             "ok" if r["ok"] else "WRONG", r["note"]]
    if tolerance and "tol" in r:
        cells.append(f"tol {r['tol']:.3e}")
    return " | ".join(map(str, cells))


def grad_reports(tolerance: bool) -> None:
    for world, dp in ((2, None), (4, 2)):
        sim = tplab.simulate(world)
        for name, (cls, plan, lm) in GRAD_CASES.items():
            make = functools.partial(models.make_tokens if lm else models.make_input, CFG)
            loss = models.lm_loss if lm else None
            report = tplab.grad_check(sim, functools.partial(cls, CFG), plan, make, loss,
                                      dp=dp)
            print(f"== grad_check {name} world={world} dp={dp or 1}: "
                  f"{'ok' if report.ok else 'FAILED'}")
            for r in report.rows:
                print("  " + row_line(r, tolerance))
            for n in report.notes:
                print(f"  note: {n}")


def train_reports() -> None:
    for world, dp in ((2, None), (4, 2)):
        sim = tplab.simulate(world)
        for name, plan in (("lm-megatron", megatron.parallelize),
                           ("lm-missing-f", MISSING_F)):
            make = functools.partial(models.make_tokens, CFG, seed=0)
            report = tplab.train_check(sim, functools.partial(models.TinyLM, CFG), plan,
                                       lambda i, make=make: make(),
                                       steps=3, loss_fn=models.lm_loss, dp=dp, live=False)
            print(f"== train_check {name} world={world} dp={dp or 1}: ok={report.ok} "
                  f"first_bad={report.first_bad_step} diverged={report.diverged}")
            for r in report.rows:
                print(f"  step {r['step']} ok={r['ok']} param={r['param']} "
                      f"diff={r['param_diff']:.3e} loss_diff={r['loss_diff']:.3e}")
            for n in report.notes:
                print(f"  note: {n}")


if __name__ == "__main__":
    grad_reports(tolerance="--no-tolerance" not in sys.argv)
    train_reports()
