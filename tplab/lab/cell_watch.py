"""One cell's watch: from the request until every rank answered, or what ended it.

`CellWatch` holds what one cell's wait knows (its replies, its number, its limits, its live
output and status line, what was freed); the lab-long `Watchdog` (watchdog.py, which states
the rules) gives it the ranks' reports, the processes and restarts. `Watchdog.wait` makes
one per cell and runs it.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from tplab.errors import (
    CellTimeout,
    CollectiveHang,
    LabError,
    RankDied,
    RankError,
    RankPlanError,
)
from tplab.lab import diagnose
from tplab.lab.replay import freed_note, replays
from tplab.lab.results import RankResults, decode, engine_died, strip_engine_id
from tplab.lab.streams import LiveOutput, StatusLine
from tplab.rank import runner as rank_side

POLL_S = 0.01  # how often output is read and replies are looked at
CHECK_S = 0.1  # how often the ranks' reports are read
STATUS_AFTER_S = 3.0  # a rank waiting this long for computing peers gets a status line
FREE_ROUNDS = 8  # collectives completed for stuck ranks, at most, before a restart
INTERRUPT_GRACE_S = 3.0


class CellWatch:
    """The wait for one cell (see the module docstring); `run()` returns its results in
    `res.ranks` order or raises what ended it."""

    def __init__(self, dog, res: RankResults, cell: int, timeout: float,
                 cell_timeout: float | None):
        self.dog, self.processes, self.world_size = dog, dog.processes, dog.world_size
        self.res, self.cell = res, cell
        self.timeout, self.cell_timeout = timeout, cell_timeout
        self.live = LiveOutput(res.ranks)
        self.status = StatusLine()
        self.started = self.changed = time.monotonic()
        self.signature = None  # the ranks' states when they last changed
        self.freed: list[list[int]] = []  # the peers that completed collectives, per round
        self.first_debt = ("", "")  # (what was owed, the table) when first freed
        self.first_where: dict[int, dict] = {}
        self.freeing_s = 0.0  # seconds spent completing collectives for stuck ranks

    def run(self) -> list:
        try:
            try:
                self._watch()
            except KeyboardInterrupt:
                with deferred_interrupts():
                    self._interrupted()
                raise
        finally:
            self.status.clear()
            self.processes.catch_up({r: self.res.reply(r) for r in self.res.finished()})
            self._pump(final=True)
        return self._collect()

    def _pump(self, final: bool = False) -> None:
        self.live.feed(self.processes.read_output())
        self.live.flush(final=final)

    def _views(self) -> dict[int, diagnose.RankView]:
        return self.dog.views_now(self.res, self.cell)

    def _watch(self) -> None:
        next_check = self.started + CHECK_S  # a quick cell never reads the reports
        while True:
            self.res.ar.wait(POLL_S)
            if not self.res.pending():
                return
            self._pump()
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + CHECK_S
            self._check_alive()
            views = self._views()
            if not self._free_owed(views):
                self._judge(views, now)

    def _judge(self, views, now: float) -> None:
        """The rules for a cell whose ranks owe nothing: a deadlock, every rank waiting
        past `timeout`, the cell past `cell_timeout`; else the status line."""
        signature = _signature(views)
        if signature != self.signature:
            self.signature, self.changed = signature, now
        waiting = [r for r, v in views.items() if v.state == "waiting"]
        if diagnose.deadlocked(views) and now - self.changed > 0.5:
            self._hang(views, "the ranks wait in collectives that cannot complete")
        all_wait = waiting and not any(v.state in ("computing", "no report")
                                       for v in views.values())
        if all_wait and now - self.changed > self.timeout:
            self._hang(views, f"every unfinished rank waited in a collective for "
                              f"{self.timeout:g} s with none computing", timeout=self.timeout)
        if self.cell_timeout is not None and now - self.started > self.cell_timeout:
            self._past_cell_timeout(views)
        if waiting and now - self.changed > STATUS_AFTER_S:
            text = diagnose.waiting_status(views, self.world_size, now - self.changed)
            if text:
                self.status.show(text)
        else:
            self.status.clear()

    # --- a stuck rank freed: no restart ---------------------------------------------------

    def _free_owed(self, views) -> bool:
        """Complete, on idle peers, collectives that waiting ranks are stuck in. True when
        it did (the watch goes on); raises (after a restart) when that is impossible."""
        debts = diagnose.owed(views)
        if not debts:
            return False
        unsure = any(v.state == "no report" for v in views.values())
        if unsure and time.monotonic() - self.started < 1.0:
            return False  # a rank's first report is on its way: say who waits, completely
        if not self.freed:
            self.first_debt = (diagnose.owed_words(views, debts, self.world_size),
                               diagnose.table(views, self.world_size))
            self.first_where = {r: v.report for r, v in views.items()}
        freeing = time.monotonic()
        calls = replays(views, debts)
        if calls is None or len(self.freed) >= FREE_ROUNDS:
            why = ("the stuck ranks could not be freed" if calls is None
                   else f"the stuck ranks still waited after {FREE_ROUNDS} collectives "
                        "were completed for them")
            self._hang(views, why)
        by_peer: dict[int, list] = {}
        for (peer, _), rows in calls.items():
            by_peer.setdefault(peer, []).extend(rows)
        self._complete(by_peer, views)
        self.freed.append(sorted(by_peer))
        self.freeing_s += time.monotonic() - freeing
        return True

    def _complete(self, by_peer: dict[int, list], views) -> None:
        """Each peer completes the collectives it owes (rows in call order)."""
        pending = []
        for peer, rows in sorted(by_peer.items()):
            rows.sort(key=lambda c: c["seq"])
            pending.append(self.processes.send([peer], rank_side.complete_pending, rows))
        deadline = time.monotonic() + 10.0
        while any(not ar.ready() for ar in pending):
            self._pump()
            self._check_alive()
            if time.monotonic() > deadline:
                self._hang(self._views(),
                           "completing the missed collectives did not free the stuck ranks")
            time.sleep(POLL_S)
        for ar in pending:
            try:
                failure = getattr(decode(ar.get()), "value", None)
            except Exception as exc:  # noqa: BLE001 - e.g. the peer's engine died
                failure = rank_side.RankFailure(type(exc).__name__, str(exc), "")
            if isinstance(failure, rank_side.RankFailure):
                self._hang(views, "completing the missed collectives failed: "
                                  f"{failure.ename}: {failure.evalue}")

    # --- when things go wrong ------------------------------------------------------------

    def _check_alive(self) -> None:
        dead = self.processes.dead()
        if not dead and any(engine_died(self.res.value(r)) for r in self.res.finished()):
            dead = self._wait_for_exit_codes()
        if dead:
            self._rank_died(dead)

    def _wait_for_exit_codes(self, seconds: float = 1.0) -> dict:
        """The hub may hear of a death before the launcher has reaped the process: give
        the exit code a moment to arrive, to say how it died."""
        deadline = time.monotonic() + seconds
        dead = {}
        while not dead and time.monotonic() < deadline:
            time.sleep(POLL_S)
            dead = self.processes.dead()
        return dead or {-1: "stopped (its engine was reported dead)"}

    def _arrived(self) -> dict:
        """Results of the ranks that finished; waits for replies still arriving (a rank
        that reported the end of its cell is sending its result: no limit applies)."""
        res, where = self.res, self.dog.where()
        for r in res.pending():
            report = where.get(r) or {}
            if report.get("state") == "finished" and report.get("cell") == self.cell:
                while not res.done(r) and r not in self.processes.dead():
                    res.ar.wait(POLL_S)
        return {r: res.value(r) for r in res.finished()}

    def _rank_died(self, dead: dict[int, str]):
        self.processes.settle(dead)  # ranks elsewhere: their last lines are on their way
        self._pump(final=True)
        lines = [f"rank {r} {how}" if r >= 0 else f"a rank {how}" for r, how in dead.items()]
        detail = "".join(f"\n--- last output of rank {r} ---\n{self.processes.log_tail(r)}"
                         for r in dead if r >= 0 and self.processes.log_tail(r))
        sentence = self.dog.restart("a rank died")
        raise RankDied(f"{'; '.join(lines)} while running the cell.{detail}\n{sentence}",
                       ranks=dead)

    def _hang(self, views, why: str, timeout: float | None = None):
        self._pump(final=True)
        results = self._arrived()
        n = self.world_size
        text = f"{diagnose.diagnosis(views, n)}\n{diagnose.table(views, n)}"
        if timeout is not None:
            text = f"the ranks waited in collectives for {timeout:g} s.\n{text}"
        sentence = self.dog.restart(why)
        raise CollectiveHang(f"{text}\n{sentence}", where={r: v.report for r, v in views.items()},
                             recovered=True, recovery_s=self.dog.last_restart_s,
                             restarted=True, results=results)

    def _past_cell_timeout(self, views):
        text = diagnose.table(views, self.world_size)
        self.processes.interrupt(self.res.pending())
        note = self._settle()
        raise CellTimeout(f"the cell ran past cell_timeout={self.cell_timeout:g} s; the ranks "
                          f"were interrupted. What each rank was doing:\n{text}\n{note}",
                          where={r: v.report for r, v in views.items()})

    def _settle(self) -> str:
        """After interrupting: free ranks stuck in collectives that interrupted peers never
        call; restart when that fails. Says which happened."""
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while self.res.pending() and time.monotonic() < deadline:
            self._pump()
            self.res.ar.wait(POLL_S)
            try:
                self._free_owed(self._views())
            except CollectiveHang as hang:
                return str(hang).rsplit("\n", 1)[-1]
        if self.res.pending():
            self._arrived()
            return self.dog.restart("ranks still waited in a collective after the interrupt")
        if self.freed:
            return ("Ranks waiting in a collective were freed by completing it on their peers "
                    "with placeholder data; no restart was needed.")
        return ""

    def _interrupted(self) -> None:
        """The stop button: interrupt every rank still running; free or restart the stuck."""
        self.processes.interrupt(self.res.pending())
        note = self._settle()
        self._pump(final=True)
        if note:
            print(f"[tplab] interrupted. {note}", file=sys.stderr, flush=True)

    # --- the end of a cell ---------------------------------------------------------------

    def _collect(self) -> list:
        res = self.res
        results = {r: res.value(r) for r in res.ranks}
        for r, value in results.items():
            if engine_died(value):
                self.live = LiveOutput([])  # what the cell printed is shown already
                self._rank_died(self._wait_for_exit_codes())
            if isinstance(value, Exception):  # an ipyparallel error outside user code
                raise LabError(f"the lab could not run the cell on rank {r}: "
                               f"{strip_engine_id(value)}")
        failures = {r: v for r, v in results.items() if isinstance(v, rank_side.RankFailure)}
        freed = freed_note(self.freed)
        if failures:
            if all(f.ename == "KeyboardInterrupt" for f in failures.values()):
                raise KeyboardInterrupt
            kind = RankPlanError if all(f.ename == "PlanError" for f in failures.values()) \
                else RankError
            error = kind({r: f.traceback for r, f in failures.items()}, self.world_size)
            if freed:
                error.args = (f"{error.args[0]}\n{self.first_debt[0]}\n{freed}",)
            raise error
        if self.freed:
            owed, table = self.first_debt
            raise CollectiveHang(f"{owed}\n{table}\n{freed}", where=self.first_where,
                                 recovered=True, restarted=False,
                                 recovery_s=self.freeing_s,
                                 results={r: results[r] for r in res.ranks})
        return [results[r] for r in res.ranks]


def _signature(views) -> tuple:
    return tuple((r, v.state, json.dumps(v.report.get("groups"), sort_keys=True))
                 for r, v in sorted(views.items()))


class deferred_interrupts:
    """While the lab recovers from an interrupt, a second stop press is held back until
    the lab is consistent again (a restart cut in half leaves ranks nobody owns)."""

    def __enter__(self):
        self.pressed = 0
        try:
            self.old = signal.signal(signal.SIGINT, self._press)
        except ValueError:  # not the main thread
            self.old = None
        return self

    def _press(self, signum, frame):
        self.pressed += 1

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        return False
