"""How long a lab's ranks may take to start, on a busy machine, and what to say when they
did not.

A workshop room starts many labs on one machine at the same moment, often just booted (a
cold file cache): every rank imports torch at once, and a rank's start takes as long as
the machine's load makes it. So the wait scales with the load, not only with this lab's
ranks: 8 s per rank per core (this lab's ranks plus the other processes ready to run,
`/proc/loadavg`), at least 60 s or the lab's `timeout`. And a rank still making progress
is not given up on at that deadline: while the lab's rank processes keep using CPU
(importing, connecting), the wait goes on, up to three times the deadline. When it does
end, `join_report` says what each rank was doing (running or sleeping, CPU used, its
last output lines), where rank 0's store was to listen, and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import psutil

from tplab.lab import processes
from tplab.rank.entry import output_paths

S_PER_RANK_PER_CORE = 8.0
MIN_START_S = 60.0
PROGRESS_WINDOW_S = 10.0  # CPU used within this long counts as progress
MAX_STRETCH = 3.0  # a progressing start may take this many times the limit


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where a start of the ranks meets: rank 0's store (`master_addr:master_port`), and
    how the ranks reach this machine. The lab plans one (its address, a free port); the
    engine kind agrees it (`EngineKind.rendezvous`: ranks elsewhere put the store on rank 0's
    host), and the transport adds where the output goes (`output_to`)."""

    master_addr: str
    master_port: int
    addr_given: bool = False  # the user's master_addr=: kept for ranks elsewhere too
    contact: str = ""  # the address of this machine that ranks elsewhere reach
    output_to: dict | None = None  # where ranks forward their output (None: files read here)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def others_ready_to_run() -> float:
    """How many other processes compete for the cores now: the runnable tasks of
    /proc/loadavg (less this one; psutil gives the load averages, not this count), or the
    one-minute load average where that is all."""
    found = 0.0
    try:
        with open("/proc/loadavg") as f:
            found = float(f.read().split()[3].split("/")[0]) - 1
    except (OSError, IndexError, ValueError):
        pass
    try:
        found = max(found, os.getloadavg()[0])
    except (AttributeError, OSError):
        pass
    return max(0.0, found)


def start_limit_s(world_size: int, timeout: float, load: float | None = None) -> float:
    """The seconds ranks get to register and join the process group (module docstring)."""
    load = others_ready_to_run() if load is None else load
    return max(MIN_START_S, timeout, S_PER_RANK_PER_CORE * (world_size + load) / cores())


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) used by `pid` and its descendants; None where unknown."""
    total, known = 0.0, False
    for p in processes.tree([pid]) or [pid]:
        try:
            used = psutil.Process(p).cpu_times()
        except psutil.Error:
            continue
        total += used.user + used.system
        known = True
    return total if known else None


STATES = {psutil.STATUS_RUNNING: "running", psutil.STATUS_SLEEPING: "sleeping (waiting)",
          psutil.STATUS_DISK_SLEEP: "waiting for the disk", psutil.STATUS_ZOMBIE: "exited",
          psutil.STATUS_STOPPED: "stopped"}


def process_state(pid: int) -> str:
    """'running', 'sleeping (waiting)' (waiting for something), ... of `pid` (psutil's
    status in words), or 'unknown'."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return "unknown"
    return STATES.get(status, status)


class StartWait:
    """A deadline that stretches while the rank processes (`pids()`) use CPU."""

    def __init__(self, limit_s: float, pids, window_s: float = PROGRESS_WINDOW_S):
        self.limit_s, self._pids, self.window_s = limit_s, pids, window_s
        self.started = time.monotonic()
        self._cpu: float | None = None
        self._progress_at = self.started

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _note_progress(self) -> None:
        used = [c for c in map(cpu_seconds, self._pids()) if c is not None]
        cpu = sum(used) if used else None
        if cpu is not None and (self._cpu is None or cpu > self._cpu + 0.05):
            self._progress_at = time.monotonic()
        self._cpu = cpu if cpu is not None else self._cpu

    def expired(self) -> bool:
        """True once past the limit with no CPU progress lately (or past the stretch)."""
        now = time.monotonic()
        if now - self.started <= self.limit_s:
            if now - self._progress_at > 1.0:
                self._note_progress()  # keep the baseline fresh, once a second
            return False
        self._note_progress()
        if now - self.started > MAX_STRETCH * self.limit_s:
            return True
        return now - self._progress_at > self.window_s


def _listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def join_report(rank: int, pids: list[int], state_dir: str, backend: str, address: str,
                port: int, waited_s: float, world_size: int, lines: int = 8) -> str:
    """Why `rank` did not join the process group in time: what every rank process was
    doing (`pids` in rank order), rank `rank`'s last output lines, where rank 0's store
    was to listen, how busy the machine is, and what to do."""
    store = (f"rank 0's store at {address}:{port} "
             + ("accepts connections" if _listens(address, port) else
                "does not accept connections (rank 0 has not opened it yet)"))
    rows = []
    for r, pid in enumerate(pids):
        cpu = cpu_seconds(pid)
        used = f", {cpu:.1f} s of CPU" if cpu is not None else ""
        rows.append(f"  rank {r} (pid {pid}): {process_state(pid)}{used}")
    tail = ""
    if rank < len(pids):
        tail = processes.log_tail(os.path.join(state_dir, "profile", "log"), pids[rank], lines)
        out_file = output_paths(state_dir, pids[rank])[0]
        try:
            with open(out_file, errors="replace") as f:
                printed = [x.rstrip() for x in f if x.strip()][-lines:]
        except OSError:
            printed = []
        tail = "\n".join(printed + ([tail] if tail else []))
    load, n = others_ready_to_run(), cores()
    busy = f"{load:.0f} other processes ready to run on {n} core{'s' if n != 1 else ''}"
    if load >= n:
        advice = (f"The machine is busy ({busy}: other labs starting at once?). Start the "
                  "lab again once the others have started, with fewer ranks, or give it "
                  f"longer: tplab.launch({world_size}, timeout=300)")
    else:
        advice = (f"The machine is not busy ({busy}), so the ranks are stuck rather than "
                  "slow: check the network setup with `python -m tplab doctor`, then start "
                  f"the lab again (tplab.launch({world_size}, timeout=300) waits longer)")
    return (f"rank {rank} did not join the process group ({backend}) within {waited_s:.0f} s; "
            f"{store}.\nWhat the ranks were doing:\n" + "\n".join(rows)
            + (f"\nRank {rank}'s last lines:\n{tail}" if tail else
               f"\nRank {rank} wrote nothing yet.")
            + f"\n{advice}. Logs: {state_dir}/profile/log")
