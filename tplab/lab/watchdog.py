"""Waiting for a cell on every rank: live output, and what to do when it does not finish.

Every `lab.run` / `lab.execute` / `%%ranks` cell goes through `Watchdog.wait`. While the
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
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from tplab.errors import CellTimeout, CollectiveHang, LabError, RankDied, RankError, RankPlanError
from tplab.lab import diagnose
from tplab.lab.replay import freed_note, replays
from tplab.lab.results import RankResults, decode, engine_died, strip_engine_id
from tplab.lab.streams import LiveOutput, StatusLine
from tplab.rank import runner as rank_side
from tplab.rank.collectives import WHERE_KEY

POLL_S = 0.01  # how often output is read and replies are looked at
CHECK_S = 0.1  # how often the ranks' reports are read
STATUS_AFTER_S = 3.0  # a rank waiting this long for computing peers gets a status line
FREE_ROUNDS = 8  # collectives completed for stuck ranks, at most, before a restart
INTERRUPT_GRACE_S = 3.0


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
        """rank -> the latest report of that rank (see reports.where_now)."""
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
        a rank whose reply came has its final report in the store (reports.end_cell),
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
        live = LiveOutput(res.ranks)
        status = StatusLine()
        state = _CellState(time.monotonic())
        try:
            try:
                self._watch(res, cell, timeout, cell_timeout, live, status, state)
            except KeyboardInterrupt:
                with deferred_interrupts():
                    self._interrupted(res, cell, live, status, state)
                raise
        finally:
            status.clear()
            self.processes.catch_up({r: res.reply(r) for r in res.finished()})
            self._pump(live, final=True)
        return self._collect(res, cell, state)

    def _pump(self, live: LiveOutput, final: bool = False) -> None:
        live.feed(self.processes.read_output())
        live.flush(final=final)

    def _watch(self, res, cell, timeout, cell_timeout, live, status, state) -> None:
        next_check = state.started + CHECK_S  # a quick cell never reads the reports
        while True:
            res.ar.wait(POLL_S)
            if not res.pending():
                return
            self._pump(live)
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + CHECK_S
            self._check_alive(res, live)
            views = self.views_now(res, cell)
            if self._free_owed(res, cell, views, state, live):
                continue
            signature = _signature(views)
            if signature != state.signature:
                state.signature, state.changed = signature, now
            waiting = [r for r, v in views.items() if v.state == "waiting"]
            if diagnose.deadlocked(views) and now - state.changed > 0.5:
                self._hang(res, cell, views, live, "the ranks wait in collectives that "
                           "cannot complete")
            all_wait = waiting and not any(v.state in ("computing", "no report")
                                           for v in views.values())
            if all_wait and now - state.changed > timeout:
                self._hang(res, cell, views, live,
                           f"every unfinished rank waited in a collective for {timeout:g} s "
                           "with none computing", timeout=timeout)
            if cell_timeout is not None and now - state.started > cell_timeout:
                self._cell_timeout(res, cell, views, live, status, state, cell_timeout)
            if waiting and now - state.changed > STATUS_AFTER_S:
                text = diagnose.waiting_status(views, self.world_size, now - state.changed)
                if text:
                    status.show(text)
            else:
                status.clear()

    # --- a stuck rank freed: no restart ---------------------------------------------------

    def _free_owed(self, res, cell, views, state, live) -> bool:
        """Complete, on idle peers, collectives that waiting ranks are stuck in. True when
        it did (the watch goes on); raises (after a restart) when that is impossible."""
        debts = diagnose.owed(views)
        if not debts:
            return False
        unsure = any(v.state == "no report" for v in views.values())
        if unsure and time.monotonic() - state.started < 1.0:
            return False  # a rank's first report is on its way: say who waits, completely
        if not state.freed:
            state.first_debt = (diagnose.owed_words(views, debts, self.world_size),
                                diagnose.table(views, self.world_size))
            state.first_where = {r: v.report for r, v in views.items()}
        freeing = time.monotonic()
        calls = replays(views, debts)
        if calls is None or len(state.freed) >= FREE_ROUNDS:
            why = ("the stuck ranks could not be freed" if calls is None
                   else f"the stuck ranks still waited after {FREE_ROUNDS} collectives "
                        "were completed for them")
            self._hang(res, cell, views, live, why)
        by_peer: dict[int, list] = {}
        for (peer, _), rows in calls.items():
            by_peer.setdefault(peer, []).extend(rows)
        pending = []
        for peer, rows in sorted(by_peer.items()):
            rows.sort(key=lambda c: c["seq"])
            pending.append(self.processes.send([peer], rank_side.complete_pending, rows))
        deadline = time.monotonic() + 10.0
        while any(not ar.ready() for ar in pending):
            self._pump(live)
            self._check_alive(res, live)
            if time.monotonic() > deadline:
                self._hang(res, cell, self.views_now(res, cell), live,
                           "completing the missed collectives did not free the stuck ranks")
            time.sleep(POLL_S)
        for ar in pending:
            try:
                message = ar.get()
                failure = getattr(decode(message), "value", None)
            except Exception as exc:  # noqa: BLE001 - e.g. the peer's engine died
                failure = rank_side.RankFailure(type(exc).__name__, str(exc), "")
            if isinstance(failure, rank_side.RankFailure):
                self._hang(res, cell, views, live, "completing the missed collectives failed: "
                           f"{failure.ename}: {failure.evalue}")
        state.freed.append(sorted(by_peer))
        state.freeing_s += time.monotonic() - freeing
        return True

    # --- when things go wrong ------------------------------------------------------------

    def _check_alive(self, res: RankResults, live: LiveOutput) -> None:
        dead = self.processes.dead()
        if not dead and any(engine_died(res.value(r)) for r in res.finished()):
            dead = self._wait_for_exit_codes()
        if dead:
            self._rank_died(dead, res, live)

    def _wait_for_exit_codes(self, seconds: float = 1.0) -> dict:
        """The hub may hear of a death before the launcher has reaped the process: give
        the exit code a moment to arrive, to say how it died."""
        deadline = time.monotonic() + seconds
        dead = {}
        while not dead and time.monotonic() < deadline:
            time.sleep(POLL_S)
            dead = self.processes.dead()
        return dead or {-1: "stopped (its engine was reported dead)"}

    def _arrived(self, res: RankResults, cell: int) -> dict:
        """Results of the ranks that finished; waits for replies still arriving (a rank
        that reported the end of its cell is sending its result: no limit applies)."""
        where = self.where()
        for r in res.pending():
            report = where.get(r) or {}
            if report.get("state") == "finished" and report.get("cell") == cell:
                while not res.done(r) and r not in self.processes.dead():
                    res.ar.wait(POLL_S)
        return {r: res.value(r) for r in res.finished()}

    def _rank_died(self, dead: dict[int, str], res: RankResults, live: LiveOutput):
        self.processes.settle(dead)  # ranks elsewhere: their last lines are on their way
        self._pump(live, final=True)
        lines = [f"rank {r} {how}" if r >= 0 else f"a rank {how}" for r, how in dead.items()]
        detail = "".join(f"\n--- last output of rank {r} ---\n{self.processes.log_tail(r)}"
                         for r in dead if r >= 0 and self.processes.log_tail(r))
        sentence = self.restart("a rank died")
        raise RankDied(f"{'; '.join(lines)} while running the cell.{detail}\n{sentence}",
                       ranks=dead)

    def _hang(self, res, cell, views, live, why: str, timeout: float | None = None):
        self._pump(live, final=True)
        results = self._arrived(res, cell)
        n = self.world_size
        text = f"{diagnose.diagnosis(views, n)}\n{diagnose.table(views, n)}"
        if timeout is not None:
            text = f"the ranks waited in collectives for {timeout:g} s.\n{text}"
        sentence = self.restart(why)
        raise CollectiveHang(f"{text}\n{sentence}", where={r: v.report for r, v in views.items()},
                             recovered=True, recovery_s=self.last_restart_s, restarted=True,
                             results=results)

    def _cell_timeout(self, res, cell, views, live, status, state, limit: float):
        text = diagnose.table(views, self.world_size)
        self._signal(res.pending())
        note = self._settle(res, cell, live, state)
        raise CellTimeout(f"the cell ran past cell_timeout={limit:g} s; the ranks were "
                          f"interrupted. What each rank was doing:\n{text}\n{note}",
                          where={r: v.report for r, v in views.items()})

    def _signal(self, ranks: list[int]) -> None:
        self.processes.interrupt(ranks)

    def _settle(self, res, cell, live, state) -> str:
        """After interrupting: free ranks stuck in collectives that interrupted peers never
        call; restart when that fails. Says which happened."""
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while res.pending() and time.monotonic() < deadline:
            self._pump(live)
            res.ar.wait(POLL_S)
            try:
                self._free_owed(res, cell, self.views_now(res, cell), state, live)
            except CollectiveHang as hang:
                return str(hang).rsplit("\n", 1)[-1]
        if res.pending():
            self._arrived(res, cell)
            return self.restart("ranks still waited in a collective after the interrupt")
        if state.freed:
            return ("Ranks waiting in a collective were freed by completing it on their peers "
                    "with placeholder data; no restart was needed.")
        return ""

    def _interrupted(self, res, cell, live, status, state) -> None:
        """The stop button: interrupt every rank still running; free or restart the stuck."""
        self._signal(res.pending())
        note = self._settle(res, cell, live, state)
        self._pump(live, final=True)
        if note:
            print(f"[tplab] interrupted. {note}", file=sys.stderr, flush=True)

    # --- the end of a cell ---------------------------------------------------------------

    def _collect(self, res: RankResults, cell: int, state) -> list:
        results = {r: res.value(r) for r in res.ranks}
        for r, value in results.items():
            if engine_died(value):
                self._rank_died(self._wait_for_exit_codes(), res, LiveOutput([]))
            if isinstance(value, Exception):  # an ipyparallel error outside user code
                raise LabError(f"the lab could not run the cell on rank {r}: "
                               f"{strip_engine_id(value)}")
        failures = {r: v for r, v in results.items() if isinstance(v, rank_side.RankFailure)}
        freed = freed_note(state.freed)
        if failures:
            if all(f.ename == "KeyboardInterrupt" for f in failures.values()):
                raise KeyboardInterrupt
            kind = RankPlanError if all(f.ename == "PlanError" for f in failures.values()) \
                else RankError
            error = kind({r: f.traceback for r, f in failures.items()}, self.world_size)
            if freed:
                error.args = (f"{error.args[0]}\n{state.first_debt[0]}\n{freed}",)
            raise error
        if state.freed:
            owed, table = state.first_debt
            raise CollectiveHang(f"{owed}\n{table}\n{freed}", where=state.first_where,
                                 recovered=True, restarted=False,
                                 recovery_s=state.freeing_s,
                                 results={r: results[r] for r in res.ranks})
        return [results[r] for r in res.ranks]


class _CellState:
    def __init__(self, started: float):
        self.started = self.changed = started
        self.signature = None
        self.freed: list[list[int]] = []
        self.first_debt = ("", "")
        self.first_where: dict[int, dict] = {}
        self.freeing_s = 0.0  # seconds spent completing collectives for stuck ranks


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
