"""Waiting for a cell on every rank: live output, and what to do when it does not finish.

Every `lab.run` / `lab.execute` / `%%ranks` cell goes through `Watchdog.wait`, which makes
one `CellWatch` (cell_watch.py: the per-cell part) and runs it; the `Watchdog` is the
lab-long part (the store's reports, restarts). While the
cell runs, the ranks' output is shown live (streams.py) and their reports (where each rank
is, tplab/rank/collectives.py) are read every 0.1 s. The rules (docs/DESIGN.md, "Cells"):
- a rank that computes is never timed out; the stop button ends it;
- `timeout` bounds how long the unfinished ranks may all wait in collectives with none
  computing; `cell_timeout` (off by default) is a wall-clock limit, for CI;
- a definite mismatch is reported at once: a rank waits in a collective that a peer
  finished the cell (or was not asked to run it) without calling, or the waiting ranks'
  collectives cannot complete. In the first case the finished peers complete it with
  placeholder zeros (collectives.complete_pending), so no restart is needed and names
  survive; otherwise `restart` (below) has the lab start fresh ranks and says what was
  lost. Every restart, here, `lab.restart()` and the next cell after a restart that did
  not finish, is the lab's one `_restart_ranks` (tplab/lab/launch.py).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from tplab.lab import diagnose
from tplab.lab.cell_watch import CellWatch
from tplab.lab.results import RankResults
from tplab.rank.collectives import WHERE_KEY


class Watchdog:
    """Runs the rules above for a Lab. What it needs of the lab is narrow: `processes`
    (exit codes, pids, output files of the ranks, requests to some of them), `restart`
    (fresh ranks, returns seconds) and `rank_names` (names lost on a restart)."""

    def __init__(self, world_size: int, processes, restart, rank_names):
        self.world_size = world_size
        self.processes, self._restart, self.rank_names = processes, restart, rank_names
        self._store = None
        self.last_restart_s: float | None = None

    # --- the rendezvous store, where ranks report where they are ------------------------

    def connect_store(self, host: str, port: int) -> None:
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=5))

    def disconnect_store(self) -> None:
        self._store = None

    def where(self) -> dict[int, dict]:
        """rank -> the latest report of that rank (see whereabouts.where_now)."""
        found = {}
        if self._store is None:
            return found
        keys = [WHERE_KEY.format(rank=r) for r in range(self.world_size)]
        try:
            values = self._store.multi_get(keys)
        except Exception:
            values = []
            for key in keys:
                try:
                    values.append(self._store.get(key) if self._store.check([key]) else b"")
                except Exception:
                    values.append(b"")
        for r, raw in enumerate(values):
            if raw:
                try:
                    found[r] = json.loads(raw)
                except ValueError:
                    continue
        return found

    def views_now(self, res: RankResults, cell: int) -> dict[int, diagnose.RankView]:
        """What each rank is doing now. Which ranks finished is read before their reports:
        a rank whose reply came has its final report in the store (whereabouts.end_cell),
        while a report read first and a reply that came just after would pair a finished
        rank with an older, running report, whose lower collective counts look like
        collectives the rank never called (a false mismatch, and a replay that hangs)."""
        done = res.finished()
        return diagnose.views(self.where(), cell, res.ranks, done, self.world_size,
                              time.time())

    # --- recovering by a restart ------------------------------------------------------

    def restart(self, why: str) -> str:
        """Start fresh ranks; the sentence that says so, and which names were lost.
        `last_restart_s` is how long it took."""
        lost = self.rank_names()
        took = self.last_restart_s = self._restart()
        names = f" Names lost: {', '.join(lost)}." if lost else ""
        return (f"The lab restarted its {self.world_size} ranks in {took:.1f} s ({why}) and is "
                f"ready again; names defined on the ranks are gone, so rerun the cells that "
                f"set them up.{names}")

    # --- waiting -----------------------------------------------------------------------

    def wait(self, res: RankResults, cell: int, timeout: float,
             cell_timeout: float | None = None) -> list:
        """Every rank's result of `cell` (`res.ranks` order), or what ended it (a
        RankError, CollectiveHang, RankDied, CellTimeout...)."""
        return CellWatch(self, res, cell, timeout, cell_timeout).run()
