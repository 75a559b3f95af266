"""The processes a lab owns: ipyparallel launchers that remember how a rank ended,
and ending process trees by pid and process group (never by name)."""

from __future__ import annotations

import os
import signal

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher


class RankLauncher(LocalEngineLauncher):
    """ipyparallel's local engine launcher, keeping the exit code where the lab can read
    it at once (ipyparallel delivers it on an event loop that a busy kernel is not running)."""

    exit_code: int | None = None

    def _wait(self):
        try:
            self.exit_code = self.process.wait()
        except psutil.Error:
            pass
        super()._wait()


class RankSetLauncher(LocalEngineSetLauncher):
    """Local engines started together (no 0.1 s stagger), each remembering its exit code."""

    launcher_class = RankLauncher

    def exit_codes(self) -> dict[int, int | None]:
        """pid -> exit code (None while running) of every engine in the set."""
        return {el.pid: el.exit_code for el in self.launchers.values()}


def how_it_ended(exit_code: int | None) -> str:
    """Words for an exit code, as psutil/subprocess report it (negative: a signal)."""
    if exit_code is None:
        return "exited (cause unknown)"
    if exit_code < 0:
        sig = -exit_code
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        why = {
            "SIGKILL": "killed by SIGKILL (the OOM killer sends this when memory runs out)",
            "SIGSEGV": "crashed with SIGSEGV (a segmentation fault in C code)",
            "SIGABRT": "aborted with SIGABRT (a C++ exception or a failed check in C code)",
            "SIGBUS": "crashed with SIGBUS",
            "SIGTERM": "terminated by SIGTERM",
        }
        return why.get(name, f"killed by {name}")
    return f"exited with status {exit_code} (os._exit, sys.exit or a fatal error)"


def tree(pids) -> list[int]:
    """The given pids and all their living descendants."""
    found: set[int] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found.add(pid)
            found.update(c.pid for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return sorted(found)


def kill_trees(pids, timeout: float = 5.0) -> list[int]:
    """SIGKILL each pid's process group (when it leads its own) and every descendant.

    Returns the pids that were still alive after `timeout` (should be none).
    """
    own_group = os.getpgrp()
    procs = []
    for pid in tree(pids):
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            continue
    for pid in pids:
        try:
            pgid = os.getpgid(pid)
        except OSError:
            continue
        if pgid == pid and pgid != own_group:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive]
