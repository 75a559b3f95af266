"""SSH ranks: ipyparallel's ssh launcher (`SSHEngineSetLauncher.engines={"host": n}`), every
host started at once. The engines run the notebook's Python path on each host; their pids
are the hosts', so the lab ends them over ssh (`kill` of the engine and its nanny), checks
them over ssh while they start, and never kills such a pid here. See docs/CLUSTER.md, "SSH".
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading

from ipyparallel.cluster.launcher import SSHEngineSetLauncher, SSHLauncher

from tplab.lab.engines import watch
from tplab.lab.engines.kind import EngineKind


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
        for el in _ssh_engines(engine_set):
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


class SSHEngineSetLauncherByHost(SSHEngineSetLauncher):
    """ipyparallel's ssh engine launcher (`engines={"host": n, ...}` and every other
    setting the same), starting all hosts at once: one thread per host, the engines of a
    host one after another (the first sends the connection files). ipyparallel starts
    every engine in turn, several ssh round trips each."""

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
