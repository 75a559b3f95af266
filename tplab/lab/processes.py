"""Local rank processes: ipyparallel launchers that remember how a rank ended, the fork
server, and ending process trees by pid and process group (never by name). The lab's one
owner of its processes is tplab/lab/cluster.py; local ranks' kind is engines/local.py."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Any, Integer

from tplab.rank.entry import output_paths


class RankLauncher(LocalEngineLauncher):
    """ipyparallel's local engine launcher, keeping the exit code where the lab can read
    it at once (ipyparallel delivers it on an event loop that a busy kernel is not running),
    and asking the hub for engine id `first_id + i`, so that engine ids say which start
    of the ranks an engine belongs to."""

    exit_code: int | None = None

    def start(self):
        first = getattr(self.parent, "first_id", 0)
        self.engine_args = [*self.engine_args, f"--IPEngine.id={first + int(self.identifier)}"]
        return super().start()

    def _wait(self):
        try:
            self.exit_code = self.process.wait()
        except psutil.Error:
            pass
        super()._wait()


class RankSetLauncher(LocalEngineSetLauncher):
    """Local engines started together (no 0.1 s stagger), each remembering its exit code."""

    launcher_class = RankLauncher
    first_id = Integer(0)

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
    # dead is enough: psutil.wait_procs would also wait for whoever inherits the ranks of a
    # killed fork server to reap them (a container's pid 1 can take seconds)
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _dead(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [p for p in alive if not _dead(p)]
    return [p.pid for p in alive]


def _dead(proc: psutil.Process) -> bool:
    """Exited (gone or a zombie); a zombie that is this process's child is reaped."""
    try:
        if proc.status() != psutil.STATUS_ZOMBIE:
            return False
        proc.wait(timeout=0)  # reaps our own child; another's zombie stays for its parent
    except (psutil.NoSuchProcess, psutil.TimeoutExpired, ChildProcessError):
        pass
    return True


class ForkServer:
    """The notebook's handle on a zygote process (`python -m tplab.rank.entry zygote`) that
    imported torch once and forks rank processes on request: a rank starts in a fraction
    of a second instead of paying torch's import again (docs/DESIGN.md: about 0.4x the floor)."""

    def __init__(self, env: dict[str, str], log_path: str):
        self.exit_codes: dict[int, int] = {}
        self._replies: queue.Queue = queue.Queue()
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tplab.rank.entry", "zygote"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env={**os.environ, **env},
                start_new_session=True, text=True, bufsize=1)
        self.pid = self.process.pid
        threading.Thread(target=self._read, daemon=True, name="tplab-zygote-reader").start()

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            if "exited" in message:
                self.exit_codes[message["exited"]] = message["code"]
            else:
                self._replies.put(message)
        self._replies.put({"closed": True})

    def wait_ready(self, timeout: float) -> None:
        reply = self._replies.get(timeout=timeout)
        if "ready" not in reply:
            raise RuntimeError("the rank fork server exited while starting")

    def fork(self, argv: list[str], env: dict[str, str], log: str, timeout: float = 30) -> int:
        self.process.stdin.write(json.dumps({"argv": argv, "env": env, "log": log}) + "\n")
        self.process.stdin.flush()
        reply = self._replies.get(timeout=timeout)
        if "pid" not in reply:
            raise RuntimeError("the rank fork server exited")
        return reply["pid"]


class ForkedEngine:
    """One rank forked by the fork server: what the lab reads of a launcher."""

    def __init__(self, pid: int, output_file: str, server: ForkServer):
        self.pid, self.output_file, self._server = pid, output_file, server

    @property
    def exit_code(self) -> int | None:
        return self._server.exit_codes.get(self.pid)


class ForkedEngineSetLauncher(RankSetLauncher):
    """Local engines forked from the lab's fork server instead of started by Popen."""

    fork_server = Any(allow_none=True)

    def start(self, n: int):
        self.n = n
        # No nanny: the fork server reports exit codes and the lab interrupts ranks by pid,
        # which is what the nanny (one more Python process per rank to start) is for.
        argv = [*self.cluster_args, *self.engine_args, "--IPEngine.enable_nanny=False"]
        env = {k: str(v) for k, v in self.get_env().items()}
        for i in range(n):
            log = os.path.join(self.profile_dir, "log",
                               f"ipengine-{self.cluster_id}-{self.engine_set_id}-{i}.log")
            pid = self.fork_server.fork([*argv, f"--IPEngine.id={self.first_id + i}"], env, log)
            self.launchers[str(i)] = ForkedEngine(pid, log, self.fork_server)
        self.notify_start([el.pid for el in self.launchers.values()])
        return []

    def signal(self, sig):
        for el in self.launchers.values():
            try:
                os.kill(el.pid, sig)
            except OSError:
                pass

    async def stop(self):
        kill_trees([el.pid for el in self.launchers.values()])
        self.notify_stop({"exit_code": None})

    def to_dict(self):
        return {}


def log_tail(log_dir: str, pid: int, lines: int = 12) -> str:
    """The last lines a rank process `pid` wrote while starting: its err file, then the
    engine logs in `log_dir`."""
    found = []
    state_dir = os.path.dirname(os.path.dirname(log_dir))
    candidates = [output_paths(state_dir, pid)[1]]
    if os.path.isdir(log_dir):
        candidates += sorted(os.path.join(log_dir, f) for f in os.listdir(log_dir))
    for path in candidates:
        try:
            with open(path, errors="replace") as f:
                found.extend(x.rstrip() for x in f if x.strip())
        except OSError:
            continue
    return "\n".join(found[-lines:])
