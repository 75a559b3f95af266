"""Interrupts at any moment: a seeded sweep of SIGINTs (the stop button) over the phases
of a lab's life, run as its own process by tests/test_interrupts.py (a stray
KeyboardInterrupt must not reach pytest). After each one the lab must answer an
all-reduce, repaired by restart() at most; at the end nothing it started may run.

    python tests/scripts/interrupt_sweep.py SEED WORLD_SIZE ROUNDS
"""

from __future__ import annotations

import _thread
import pathlib
import random
import sys
import threading
import time

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))  # tests/: pids.py
from pids import wait_gone  # noqa: E402

import tplab  # noqa: E402
import tplab.lab.launch  # noqa: F401  (an interrupt inside `import torch` breaks Python itself)

ALLREDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
PHASES = {
    "computing": "import time\ntime.sleep(0.6)",
    "hang": "if rank == 0:\n    dist.barrier()",  # freed by the peers: a recovery
    "mismatch": ("if rank == 0:\n    dist.all_reduce(torch.ones(1))\n"
                 "else:\n    dist.broadcast(torch.ones(1), 0)"),
    "waiting": "import time\nif rank == 1:\n    time.sleep(0.5)\ndist.barrier()",
}


BOUND_S = 30  # generous: a bound on waits that end on an event, for a loaded machine


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def interrupt(after: list[float]) -> list[threading.Timer]:
    timers = [threading.Timer(t, _thread.interrupt_main) for t in after]
    for t in timers:
        t.start()
    return timers


def settle(timers) -> None:
    """No press of these timers comes later: each is cancelled, and joined (one that woke
    before cancel() has pressed once its thread ended; on a loaded machine that can be
    well after 0.05 s, and its press once broke the next round); a press raises here."""
    pending = list(timers)
    while pending:
        try:
            for t in pending:
                t.cancel()
            for t in pending:
                t.join()
            pending = []
            time.sleep(0.05)  # a press from a timer that just ended raises here, not later
        except KeyboardInterrupt:
            pass


def answers(lab, n: int) -> str:
    """'ok', or 'repaired' when restart() was needed; raises when even that fails."""
    for attempt in range(3):
        try:
            if lab.execute(ALLREDUCE, timeout=30) == [float(n)] * n:
                return "ok" if attempt == 0 else "repaired"
        except KeyboardInterrupt:
            continue
        except tplab.LabError:
            lab.restart()
    raise AssertionError("the lab does not answer an all-reduce, even after restart()")


def main(seed: int, n: int, rounds: int) -> None:
    rng = random.Random(seed)
    before = children()
    timers = interrupt([rng.uniform(0.05, 1.0)])  # during launch
    try:
        tplab.launch(n).shutdown()
    except KeyboardInterrupt:
        pass
    settle(timers)
    leaked = wait_gone(children() - before, BOUND_S)  # they end on their own: wait for it
    assert not leaked, leaked
    lab = tplab.launch(n)
    outcomes: dict[str, int] = {}
    for _ in range(rounds):
        phase = rng.choice([*PHASES, "restart", "twice"])
        at = rng.uniform(0.0, 0.7)
        timers = interrupt([at, at + rng.uniform(0.01, 0.3)] if phase == "twice" else [at])
        try:
            if phase == "restart":
                lab.restart()
            else:
                lab.execute(PHASES["hang" if phase == "twice" else phase], timeout=30)
        except (KeyboardInterrupt, tplab.LabError):
            pass
        settle(timers)
        outcome = answers(lab, n)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    pids = lab.pids
    lab.shutdown()
    alive = wait_gone(pids, BOUND_S)
    assert not alive, f"still running {BOUND_S} s after shutdown: {alive}"
    print(f"sweep ok: seed {seed}, world {n}, {rounds} interrupts, {outcomes}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
