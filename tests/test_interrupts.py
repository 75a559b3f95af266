"""The stop button at any moment (launch, run, restart, recovery, twice in a row) leaves
a lab that works or that restart() repairs, and nothing leaks (tests/scripts/).

The default run sweeps world 2 (10 interrupts); the sweep at world 4 (another seed) is
`extended`: an interrupt reaching every rank of a 4-rank lab, in a collective and asleep,
is tests/test_faults.py's test_interrupt_reaches_every_rank[world4-...]."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SWEEP = pathlib.Path(__file__).parent / "scripts" / "interrupt_sweep.py"


@pytest.mark.parametrize(("seed", "world_size", "rounds"), [
    (7, 2, 10), pytest.param(11, 4, 8, marks=pytest.mark.extended)])
def test_interrupt_sweep(seed, world_size, rounds, tmp_path):
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython")}
    done = subprocess.run([sys.executable, str(SWEEP), str(seed), str(world_size), str(rounds)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"sweep ok: seed {seed}, world {world_size}, {rounds} interrupts" in done.stdout
