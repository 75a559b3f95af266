"""Do train_check and grad_check agree with an independent one-device truth? (goal: 0
disagreements in 500 draws; issue 27)

Each draw (tests/verdict_draws.py) is a random small model, plan and training step at world
2 or 4, correct or with a bug planted from a list (f omitted, g omitted, wrong style,
dropout masks that differ per rank, a missing dp all-reduce, wrong batch slicing). The
truth runs the same parallel model with plain torch on the ranks and compares every rank's
local pieces with a plain one-device run; it does not look at the label. A draw whose
truth is unclear (between rounding and a bug) is counted apart, not judged.

    .venv/bin/python benchmarks/verdicts.py [--draws 500] [--seed 0] [--processes]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path.insert(0, TESTS)

import verdict_draws  # noqa: E402  (tests/verdict_draws.py)

import tplab  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", action="store_true",
                   help="rank processes (tplab.launch) instead of tplab.simulate")
    p.add_argument("--verbose", action="store_true", help="a line per draw")
    args = p.parse_args()
    if args.processes:  # the ranks import verdict_draws by name
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = random.Random(args.seed)
    labs: dict[int, object] = {}
    counts: collections.Counter = collections.Counter()
    wrong = []
    start = time.perf_counter()
    try:
        for k in range(args.draws):
            dr = verdict_draws.draw(r)
            if dr.world not in labs:
                labs[dr.world] = (tplab.launch(dr.world, timeout=60) if args.processes
                                  else tplab.simulate(dr.world))
            truth, ok = verdict_draws.judge(labs[dr.world], dr)
            counts[truth] += 1
            counts["bug planted"] += dr.bug is not None
            if truth != "unclear" and (truth == "ok") != ok:
                wrong.append((k, truth, ok, dr))
            if args.verbose:
                print(k, truth, ok, dr, flush=True)
    finally:
        for lab in labs.values():
            lab.shutdown()
    seconds = time.perf_counter() - start
    mode = "processes" if args.processes else "simulated"
    print(f"verdicts ({mode}, seed {args.seed}): {args.draws} draws, {counts['bug planted']} "
          f"with a bug planted; truth ok {counts['ok']}, bad {counts['bad']}, unclear "
          f"{counts['unclear']}; disagreements: {len(wrong)} ({seconds:.0f} s)")
    for k, truth, ok, dr in wrong:
        print(f"  draw {k}: truth {truth}, tplab {'ok' if ok else 'not ok'}: {dr}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
