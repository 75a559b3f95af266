"""Waiting for a cell on every rank, and saying what went wrong when it does not finish.

Every `lab.run` / `lab.execute` / `%%ranks` cell goes through `Watchdog.wait`, which
returns the per-rank results or raises one of:
- `RankError`: user code raised on some ranks (ranks left waiting for them in a
  collective are restarted, so the lab stays usable);
- `RankDied`: a rank process ended mid-cell (crash, signal, os._exit, OOM killer);
- `CollectiveHang`: the cell ran past its timeout; the message is a per-rank table of
  where each rank is, read from the reports ranks write to the rendezvous store.
After each of these the lab restarts its ranks and is ready again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from datetime import timedelta

from ipyparallel import error as ipp_error

from tplab.errors import CollectiveHang, LabError, RankDied, RankError, RankPlanError
from tplab.lab import diagnose
from tplab.lab import rank as rank_side
from tplab.lab.output import print_grouped
from tplab.lab.transfer import from_wire, is_wire, unpack

# Ranks still in a collective this long after another rank failed are waiting for it: stuck.
STUCK_AFTER_FAILURE_S = 2.0
POLL_S = 0.05


class RankResults:
    """One ipyparallel AsyncResult over several ranks, looked at rank by rank."""

    def __init__(self, ar, ranks: list[int]):
        self.ar, self.ranks = ar, ranks
        self._futures = dict(zip(ranks, ar._children, strict=True))  # one per target
        self._replies: dict = {}

    def done(self, r: int) -> bool:
        return self._futures[r].done()

    def pending(self) -> list[int]:
        return [r for r in self.ranks if not self._futures[r].done()]

    def result(self, r: int):
        """The rank's Reply; an ipyparallel error (engine died...) is returned, not raised."""
        if r not in self._replies:
            message = self._futures[r].result()
            self._replies[r] = from_wire(message) if is_wire(message) else message
        return self._replies[r]

    def value(self, r: int):
        """The rank's value, RankFailure or ipyparallel error, once it is done."""
        reply = self.result(r)
        return reply.value if isinstance(reply, rank_side.Reply) else reply

    def output(self) -> tuple[dict[int, str], dict[int, str]]:
        replies = {r: self.result(r) for r in self.ranks if self.done(r)}
        replies = {r: v for r, v in replies.items() if isinstance(v, rank_side.Reply)}
        return ({r: v.stdout for r, v in replies.items()},
                {r: v.stderr for r, v in replies.items()})


class Watchdog:
    def __init__(self, lab):
        self.lab = lab
        self._store = None

    # --- the rendezvous store, where ranks report where they are ------------------------

    def connect_store(self, host: str, port: int) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=5))

    def disconnect_store(self) -> None:
        self._store = None

    def where(self) -> dict[int, dict]:
        """rank -> the latest report of that rank (see rank.where_now)."""
        found = {}
        if self._store is None:
            return found
        for r in range(self.lab.world_size):
            key = rank_side.WHERE_KEY.format(rank=r)
            try:
                if self._store.check([key]):
                    found[r] = json.loads(self._store.get(key))
            except Exception:
                continue
        return found

    # --- waiting -----------------------------------------------------------------------

    def wait_for_init(self, ars: list) -> list[int]:
        deadline = time.monotonic() + max(60.0, self.lab.timeout)
        pids = []
        for r, ar in enumerate(ars):
            while not ar.ready():
                self.lab._check_engines_alive(starting=True)
                if time.monotonic() > deadline:
                    raise LabError(f"rank {r} did not join the process group in time")
                ar.wait(POLL_S)
            try:
                pids.append(ar.get(0))
            except ipp_error.RemoteError as exc:
                detail = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(exc.render_traceback()))
                raise LabError(f"rank {r} could not join the process group "
                               f"({self.lab.backend}):\n{detail}") from None
        return pids

    def wait(self, cell_results: RankResults, cell: int, timeout: float) -> list:
        res = cell_results
        started = time.monotonic()
        failed_at = None
        try:
            while True:
                res.ar.wait(POLL_S)  # returns as soon as every rank is done
                pending = res.pending()
                if not pending:
                    break
                now = time.monotonic()
                dead = self.lab._check_engines_alive()
                finished = [r for r in res.ranks if r not in pending]
                if dead or any(_engine_died(res.value(r)) for r in finished):
                    self._rank_died(self._wait_for_exit_codes(dead))
                if failed_at is None and any(
                        isinstance(res.value(r), rank_side.RankFailure) for r in finished):
                    failed_at = now
                if failed_at is not None and now - failed_at > STUCK_AFTER_FAILURE_S \
                        and self._waiting_in_collective(pending, cell):
                    break  # they wait for the failed ranks, which will never join
                if now - started > timeout:
                    self._hang(res, cell, timeout)
        except KeyboardInterrupt:
            self._interrupt(res)
            raise
        return self._collect(res, cell)

    def _waiting_in_collective(self, ranks: list[int], cell: int) -> bool:
        where = self.where()
        return any(where.get(r, {}).get("cell") == cell
                   and where[r].get("state") == "in_collective" for r in ranks)

    def _collect(self, res: RankResults, cell: int) -> list:
        stuck = res.pending()
        results = {r: res.value(r) for r in res.ranks if r not in stuck}
        for value in results.values():
            if _engine_died(value):
                self._rank_died(self._wait_for_exit_codes({}))
            if isinstance(value, Exception):  # an ipyparallel error outside user code
                raise LabError(f"the lab could not run the cell: {value}")
        out, err = res.output()
        print_grouped(out, sys.stdout)
        print_grouped(err, sys.stderr)
        failures = {r: v for r, v in results.items() if isinstance(v, rank_side.RankFailure)}
        if failures:
            if all(f.ename == "KeyboardInterrupt" for f in failures.values()):
                raise KeyboardInterrupt
            note = ""
            if stuck:
                where = self.where()
                took = self.lab.restart()
                note = diagnose.stuck_note(stuck, where, cell, took)
            kind = RankPlanError if all(f.ename == "PlanError" for f in failures.values()) \
                else RankError
            error = kind({r: f.traceback for r, f in failures.items()}, self.lab.world_size)
            if note:
                error.args = (f"{error.args[0]}\n{note}",)
            raise error
        return [unpack(results[r]) for r in res.ranks]

    # --- when things go wrong ------------------------------------------------------------

    def _hang(self, res: RankResults, cell: int, timeout: float):
        time.sleep(3 * rank_side.REPORT_INTERVAL_S)  # let every rank's reporter write
        finished = [r for r in res.ranks if res.done(r)]
        where = self.where()
        table = diagnose.hang_report(where, cell, finished, res.ranks, timeout)
        took = self.lab.restart()
        raise CollectiveHang(
            f"{table}\nThe lab restarted its {self.lab.world_size} ranks in {took:.1f} s and is "
            "ready again; names defined on the ranks are gone, so rerun the cells that set "
            "them up.", where=where, recovered=True, recovery_s=took)

    def _wait_for_exit_codes(self, dead: dict[int, str], seconds: float = 1.0) -> dict:
        """The hub may hear of a death (from the rank's nanny) before our launcher has
        reaped the process: give the exit code a moment to arrive, to say how it died."""
        deadline = time.monotonic() + seconds
        while not dead and time.monotonic() < deadline:
            time.sleep(POLL_S)
            dead = self.lab._check_engines_alive()
        return dead

    def _rank_died(self, dead: dict[int, str]):
        if not dead:
            dead = {-1: "stopped (its engine was reported dead)"}
        lines = [f"rank {r} {how}" if r >= 0 else f"a rank {how}" for r, how in dead.items()]
        logs = [self.lab._rank_log_tail(r) for r in dead if r >= 0]
        took = self.lab.restart()
        detail = "".join(f"\n--- last output of rank {r} ---\n{log}"
                         for r, log in zip([r for r in dead if r >= 0], logs, strict=True) if log)
        raise RankDied(f"{'; '.join(lines)} while running the cell.{detail}\nThe lab restarted "
                       f"its {self.lab.world_size} ranks in {took:.1f} s and is ready again; "
                       "names defined on the ranks are gone, so rerun the cells that set "
                       "them up.",
                       ranks=dead)

    def _interrupt(self, res: RankResults) -> None:
        """Interrupt every rank still running; restart those stuck in a collective."""
        pending = res.pending()
        for r in pending:
            try:
                os.kill(self.lab._rank_pids[r], signal.SIGINT)
            except (OSError, IndexError):
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and res.pending():
            time.sleep(POLL_S)
        if res.pending():
            took = self.lab.restart()
            print(f"[tplab] interrupted; ranks waiting in a collective were restarted in "
                  f"{took:.1f} s, and the lab is ready again", file=sys.stderr)


def _engine_died(value) -> bool:
    return isinstance(value, ipp_error.EngineError) or (
        isinstance(value, ipp_error.RemoteError) and value.ename == "EngineError")
