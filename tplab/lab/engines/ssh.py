"""SSH ranks: ipyparallel's ssh launcher (`SSHEngineSetLauncher.engines={"host": n}`), every
host started at once, each step on a host a shell command or a standard-library Python
(ipyparallel's own steps import IPython or ipyparallel there, about a second of CPU each).
The engines run the notebook's Python path on each host; their pids are the hosts', so
the lab ends them over ssh (`kill` of the engine and its nanny), checks them over ssh while
they start, and never kills such a pid here. See docs/CLUSTER.md, "SSH".
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher, SSHLauncher
from ipyparallel.cluster.shellcmd import ShellCommandSend

from tplab.lab.engines import watch
from tplab.lab.engines.kind import EngineKind

# How often, while it starts, a running engine's output is read over ssh for a fatal line.
# Its exit needs no such poll: the launcher's wait loop on the host says it at once, and
# each ssh login costs about 0.2 s of CPU on the two sides.
OUTPUT_READ_S = 6.0
LOCAL_FILES_S = 10.0  # how long the connection files may take to appear (ipyparallel's wait)


class SSHKind(EngineKind):
    name = "ssh"
    launcher_base = SSHEngineSetLauncher

    def __init__(self, launcher=None, fork: bool = False):
        super().__init__(launcher)
        if launcher in (None, "ssh", SSHEngineSetLauncher):  # ipyparallel's, hosts at once
            self.launcher = SSHEngineSetLauncherByHost

    def configure(self, config, env: dict, state_dir: str) -> None:
        """The same Python on the hosts (tplab at the same path, as on a shared file
        system), and a remote profile folder of its own (on one machine, scp onto the
        lab's own profile folder would truncate the files it sends)."""
        super().configure(config, env, state_dir)
        config.SSHLauncher.remote_python = sys.executable
        config.SSHLauncher.remote_profile_dir = os.path.join(state_dir, "remote-profile")

    def local_pids(self, engine_set) -> list[int]:
        return []  # every pid of an ssh engine is a process on its host

    def stop(self, engine_sets, timeout: float = 10.0) -> None:
        """Kill each engine's process group (the engine and its nanny) on its host."""
        calls = []
        for engine_set in engine_sets:
            for el in _ssh_engines(engine_set):
                script = (f"kill -9 $(ps -o pid= --ppid {el.pid}) {el.pid} 2>/dev/null; "
                          f"kill -9 -- -{el.pid} 2>/dev/null; true")
                calls.append((_quiet, (_ssh, el, script, timeout)))
        all_at_once(calls)

    def check(self, engine_set, remote: bool, state_dir: str) -> str | None:
        if not remote:
            return None
        now = time.monotonic()
        for el in _ssh_engines(engine_set):
            if isinstance(el, LeanSSHEngineLauncher):
                if not el.exited and now < el.next_output_read:
                    continue  # running, and its output was read a moment ago
                el.next_output_read = now + OUTPUT_READ_S
            out_file = shlex.quote(el.remote_output_file)
            script = (f"kill -0 {el.pid} 2>/dev/null && echo __alive__; "
                      f"tail -n 40 {out_file} 2>/dev/null")
            try:
                out = _ssh(el, script, timeout=10)
            except subprocess.TimeoutExpired:
                continue
            lines = [x.rstrip() for x in out.splitlines() if x.strip()]
            alive = "__alive__" in lines
            lines = [x for x in lines if x != "__alive__"]
            fatal = watch.fatal_part(lines)
            where = f"{el.location}:{el.remote_output_file}"
            if not alive:
                return watch.message(f"the engine on {el.location} (remote pid {el.pid}) "
                                     "exited before it registered", fatal or lines[-12:],
                                     where, state_dir)
            if fatal:
                return watch.message(f"the engine on {el.location} failed", fatal, where,
                                     state_dir)
        return None


def _ssh(el, script: str, timeout: float = 10.0) -> str:
    cmd = [*el.ssh_cmd, *el.ssh_args, el.location, script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    return out.stdout + out.stderr


def _ssh_engines(engine_set) -> list:
    return [el for el in getattr(engine_set, "launchers", {}).values()
            if isinstance(el, SSHLauncher) and getattr(el, "pid", 0) > 0]


def _quiet(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - best effort at shutdown: the host may be gone
        pass


def all_at_once(calls) -> None:
    """Run (fn, args) pairs each in a thread of its own; return when all have."""
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class LeanSSHEngineLauncher(SSHEngineLauncher):
    """ipyparallel's ssh engine launcher (SSHLauncher.start's steps, in its order) with
    nothing imported on the host but the engine itself: the profile folder made by `mkdir`
    (not `python -m IPython profile create`), the connection files sent once per lab (a
    restart finds them there), the file and start commands sent as
    ipyparallel's own standard-library receiver code (`send_receiver_code`, not an import
    of ipyparallel), and the wait for the engine's exit a shell loop (not ipyparallel's
    `ssh_waitpid`, which imports ipyparallel on the host every `poll_seconds`), whose
    end sets `exited` (SSHKind.check reads the engine's output then, not every time)."""

    exited = False  # the wait loop saw the engine's process gone on its host
    next_output_read = 0.0  # SSHKind.check's: when to read the output of a running engine

    @property
    def ssh_sender(self) -> ShellCommandSend:
        if self._ssh_sender is None:
            self._ssh_sender = ShellCommandSend(self.ssh_cmd, [*self.ssh_args, self.location],
                                                self.remote_python, log=self.log,
                                                send_receiver_code=True)
        return self._ssh_sender

    def start(self, hostname=None, user=None, port=None):
        if hostname is not None:
            self.hostname = hostname
        if user is not None:
            self.user = user
        if port is not None:
            for flag, args in (("-p", self.ssh_args), ("-P", self.scp_args)):
                if flag not in args:
                    args += [flag, str(port)]
        profile, q = self.remote_profile_dir, shlex.quote
        # One round trip: the folders `IPython profile create` would make that are used
        # before the engine runs (its output file, the connection files; the engine makes
        # the others), and whether the connection files are there already (a restart: the
        # same controller's files, in this lab's own remote profile folder).
        there = "".join(f" && test -f {q(remote)}" for _, remote in self.to_send)
        script = (f"mkdir -p {q(profile + '/log')} && mkdir -p -m 700 "
                  f"{q(profile + '/security')} || exit 1; true{there} && echo __sent__; true")
        if "__sent__" not in self.ssh_sender.check_output(shlex.join(["sh", "-c", script])):
            wait_for_files([local for local, _ in self.to_send], LOCAL_FILES_S)
            self.send_files()
        self.pid = self.ssh_sender.cmd_start(self.program + self.program_args,
                                             env=self.get_env(),
                                             output_file=self.remote_output_file)
        self.notify_start({"host": self.location, "pid": self.pid})
        self._start_waiting()
        self.fetch_files()

    def wait_one(self, timeout):
        """Wait up to `timeout` s (None: for ever) for the engine to exit on its host:
        TimeoutError if it still runs, else -1 (as ipyparallel's: no exit code over ssh)."""
        limit = "" if timeout is None else f" && [ $i -lt {int(timeout)} ]"
        script = (f"i=0; while kill -0 {self.pid} 2>/dev/null{limit}; do sleep 1; "
                  f"i=$((i+1)); done; kill -0 {self.pid} 2>/dev/null && echo __running__; true")
        if "__running__" in self.ssh_sender.check_output(shlex.join(["sh", "-c", script])):
            raise TimeoutError("still running")
        self.exited = True
        return -1


def wait_for_files(paths: list[str], seconds: float) -> None:
    """Until every path exists (the controller writes the connection files once it runs),
    or `seconds` pass; ipyparallel's send_files looks once a second."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


class SSHEngineSetLauncherByHost(SSHEngineSetLauncher):
    """ipyparallel's ssh engine launcher (`engines={"host": n, ...}` and every other
    setting the same), starting all hosts at once: one thread per host, the engines of a
    host one after another (the first sends the connection files). ipyparallel starts
    every engine in turn, several ssh round trips each. Each engine is a
    LeanSSHEngineLauncher."""

    launcher_class = LeanSSHEngineLauncher

    def start(self, n):
        shared = set(self.traits(config=True)).intersection(
            self.launcher_class.class_traits(config=True))
        inherited = shared.difference({"location", "user", "hostname", "to_send",
                                       "to_fetch"}).union({"profile_dir", "cluster_id"})
        groups, started = [], 0
        for full_host, n_or_config in self.engines.items():
            overrides = dict(n_or_config) if isinstance(n_or_config, dict) else {}
            count = overrides.pop("n", 1) if isinstance(n_or_config, dict) else n_or_config
            user, _, host = full_host.rpartition("@")
            host, _, port = host.partition(":")
            group = []
            for i in range(min(count, n - started)):
                key = f"{full_host}/{i}"
                kwargs = {name: getattr(self, name) for name in inherited}
                kwargs.update(overrides)
                el = self.launchers[key] = self.launcher_class(parent=self, identifier=key,
                                                               **kwargs)
                if i > 0:
                    el.to_send = []
                el.on_stop(self._notice_engine_stopped)
                el.loop  # noqa: B018 - bind the main thread's event loop before the threads
                group.append((el, user or None, host, port or None))
                started += 1
            groups.append(group)
        errors: list[BaseException] = []

        def start_one(el, user, host, port):
            try:
                el.start(user=user, hostname=host, port=port)
            except Exception as exc:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(exc)

        def start_host(group):  # the first engine makes the profile and sends the files
            start_one(*group[0])
            all_at_once([(start_one, item) for item in group[1:]] if not errors else [])

        all_at_once([(start_host, (g,)) for g in groups if g])
        if errors:
            raise errors[0]
        self.n = started
        self.notify_start(list(self.launchers))
        return list(self.launchers)


KIND = SSHKind
