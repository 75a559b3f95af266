"""Engines started by ipyparallel's other launchers (mpi, ssh, slurm...): notebook side.

What the lab needs from them beyond what ipyparallel does:
- a start failure reported within seconds, with the engines' own last error lines and the
  fix (`EngineWatch`): the launcher process exited (mpiexec), the batch job left the queue
  (Slurm), a remote engine process is gone (ssh), or an engine log has a fatal line;
- which pids are local processes the lab may kill (`local_pids`: never a remote pid);
- ending what runs elsewhere at shutdown (`stop_remote`): `kill` over ssh for ssh
  engines, `scancel` (the launcher's delete command) for batch jobs;
- the lab's defaults for each launcher (`configure`: heartbeat watch, environment
  forwarded by mpiexec, sbatch's errors kept), ssh hosts started at once
  (`SSHEngineSetLauncherByHost`), and a launcher that fails at once (`start_error`).
See docs/CLUSTER.md, and ipyparallel's launchers (ipyparallel.cluster.launcher).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import threading
import time

from ipyparallel.cluster.launcher import (
    BatchSystemLauncher,
    LocalProcessLauncher,
    SSHEngineSetLauncher,
    SSHLauncher,
)

# A line that says an engine could not start (ipyparallel logs "CRITICAL" on fatal errors).
FATAL = re.compile(r"Traceback \(most recent call last\)|\bCRITICAL\b|\bFATAL\b"
                   r"|^\S*Error: |^ORTE was unable|^mpiexec (was unable|has detected|noticed)"
                   r"|^srun: error|^sbatch: error|^ssh: |Permission denied \(publickey")
# (what the engines said, what to do about it)
HINTS = [
    (re.compile(r"No module named '?mpi4py"),
     'the engines run with --mpi and need mpi4py: pip install "tplab[mpi]" into the Python '
     "that the engines run (on every host)"),
    (re.compile(r"No module named '?(tplab|torch|ipyparallel)"),
     "install tplab (pip install tplab) into the Python the engines run on every host, or "
     "point the engines at one that has it: "
     "cluster_options={'config': {'EngineLauncher': {'engine_cmd': [PYTHON, '-m', "
     "'tplab.lab.entry', 'engine']}}}"),
    (re.compile(r"allow-run-as-root|run(ning)? as root"),
     "Open MPI refuses to run as root: set OMPI_ALLOW_RUN_AS_ROOT=1 and "
     "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, or pass mpi_args=['--allow-run-as-root']"),
    (re.compile(r"not enough slots"),
     "mpiexec has fewer slots than ranks: list more slots in the hostfile, or add "
     "'--oversubscribe' to mpi_args"),
    (re.compile(r"Permission denied \(publickey|Host key verification failed"),
     "ssh could not log in: check that `ssh HOST true` works without a password "
     "(ssh-agent or a key in ~/.ssh, the host in known_hosts)"),
    (re.compile(r"Could not resolve hostname|No route to host|Connection refused|timed out"),
     "a host could not be reached: check the host names and that sshd runs there"),
    (re.compile(r"Registration timed out|registration.*timed out", re.I),
     "the engines could not reach the controller: give tplab.launch an ip= that the "
     "engines' hosts can reach (an address of this machine on their network, or '0.0.0.0')"),
    (re.compile(r"invalid partition|invalid account", re.I),
     "Slurm refused the job: set the partition with "
     "cluster_options={'config': {'SlurmEngineSetLauncher': {'queue': NAME}}}"),
    (re.compile(r"command not found|No such file or directory.*(mpiexec|sbatch|srun)"),
     "a launcher command is missing: install Open MPI (mpiexec) or Slurm (sbatch, srun), "
     "or put them on PATH"),
]


def configure(config, engines: str, env: dict, state_dir: str) -> None:
    """The lab's defaults for another launcher (the user's cluster_options config wins):
    - ssh: run the same Python on the hosts (tplab installed at the same path, as on a
      shared file system), and a remote profile folder of its own (on one machine, scp
      onto the lab's own profile folder would truncate the files it sends);
    - every launcher: engines watch the controller's heartbeat (entry.py), not a pid;
    - mpi: forward the lab's environment to every engine (`mpiexec -x NAME` for Open MPI,
      `-genvlist` for MPICH), which mpiexec does not do for processes on other hosts."""
    import sys

    from tplab.lab.entry import FIRST_ID_ENV, HEARTBEAT_ENV

    name = engines.lower() if isinstance(engines, str) else getattr(engines, "__name__", "")
    if "ssh" in name:
        config.SSHLauncher.remote_python = sys.executable
        config.SSHLauncher.remote_profile_dir = os.path.join(state_dir, "remote-profile")
    env[HEARTBEAT_ENV] = "connection-file"  # engines watch the heartbeat, not the owner pid
    if "slurm" in name:  # keep what sbatch says on failure (ipyparallel does not capture it)
        os.makedirs(os.path.dirname(submit_errors(state_dir)), mode=0o700, exist_ok=True)
        # the batch script goes to the lab's folder, not the notebook's working directory
        config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
            state_dir, "slurm_engine.sbatch")
        config.SlurmLauncher.submit_command = [
            "sh", "-c", 'sbatch "$@" 2>"$0"; s=$?; cat "$0" >&2; exit $s',
            submit_errors(state_dir)]
    if "mpi" in name:
        names = [*env, "IPP_CLUSTER_ID", "IPP_PROFILE_DIR", FIRST_ID_ENV]
        try:
            version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                                     timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            version = ""
        if "Open MPI" in version or "OpenRTE" in version:
            config.MPILauncher.mpi_cmd = ["mpiexec", *(a for n in names for a in ("-x", n))]
        elif version:  # MPICH / Intel MPI (Hydra)
            config.MPILauncher.mpi_cmd = ["mpiexec", "-genvlist", ",".join(names)]


def submit_errors(state_dir: str) -> str:
    """Where the batch submit command's error output goes (the lab's log folder)."""
    return os.path.join(state_dir, "profile", "log", "submit.err")


def start_error(engines, exc: BaseException, state_dir: str):
    """A LabError for a launcher that could not even start its engines (sbatch, ssh or
    mpiexec failed at once), with what the command said and the fix."""
    from tplab.errors import LabError

    first = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, subprocess.CalledProcessError):
        cmd = [str(c) for c in (exc.cmd if isinstance(exc.cmd, list) else [exc.cmd])]
        if cmd[:2] == ["sh", "-c"] and "sbatch" in cmd[2]:  # configure()'s wrapper
            cmd = ["sbatch", *cmd[4:]]
        first = f"`{' '.join(cmd)}` exited with status {exc.returncode}"
    parts = [first, getattr(exc, "output", None), getattr(exc, "stderr", None),
             "\n".join(_tail(submit_errors(state_dir)))]
    said = "\n".join(p.decode(errors="replace") if isinstance(p, bytes) else str(p)
                     for p in parts if p)
    fix = hint_for(said)
    return LabError(f"the engines ({engines!r}) could not be started: {said.strip()}\n"
                    + (f"Fix: {fix}\n" if fix else "")
                    + f"(logs: {state_dir}/profile/log)")


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
            _all_at_once([(start_one, item) for item in group[1:]] if not errors else [])

        _all_at_once([(start_host, (g,)) for g in groups if g])
        if errors:
            raise errors[0]
        self.n = started
        self.notify_start(list(self.launchers))
        return list(self.launchers)


def _all_at_once(calls) -> None:
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def hint_for(text: str) -> str:
    """The fix for what the engines said, or "" when none is known."""
    for pattern, fix in HINTS:
        if pattern.search(text):
            return fix
    return ""


def local_pids(engine_set) -> list[int]:
    """The pids of local processes an engine set runs: mpiexec, or local engines. Never
    a remote pid (an ssh engine's pid is a process on another host), nor a batch job."""
    if isinstance(engine_set, SSHLauncher) or isinstance(engine_set, BatchSystemLauncher):
        return []
    pids = []
    if isinstance(engine_set, LocalProcessLauncher) and getattr(engine_set, "pid", 0) > 0:
        pids.append(engine_set.pid)
    for el in getattr(engine_set, "launchers", {}).values():
        if not isinstance(el, SSHLauncher) and getattr(el, "pid", 0) > 0:
            pids.append(el.pid)
    return pids


def _ssh(el, script: str, timeout: float = 10.0) -> str:
    cmd = [*el.ssh_cmd, *el.ssh_args, el.location, script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    return out.stdout + out.stderr


def _ssh_engines(engine_set) -> list:
    return [el for el in getattr(engine_set, "launchers", {}).values()
            if isinstance(el, SSHLauncher) and getattr(el, "pid", 0) > 0]


def stop_remote(engine_sets, timeout: float = 10.0) -> None:
    """End engines that run elsewhere: kill each ssh engine's process group on its host;
    cancel batch jobs. Local processes are ended by pid elsewhere (processes.kill_trees)."""
    threads = []
    for engine_set in engine_sets:
        for el in _ssh_engines(engine_set):
            script = (f"kill -9 $(ps -o pid= --ppid {el.pid}) {el.pid} 2>/dev/null; "
                      f"kill -9 -- -{el.pid} 2>/dev/null; true")  # the engine and its nanny
            threads.append(threading.Thread(target=_quiet, args=(_ssh, el, script, timeout)))
        job = getattr(engine_set, "job_id", "") if isinstance(
            engine_set, BatchSystemLauncher) else ""
        if job:
            cmd = [*engine_set.delete_command, str(job)]
            threads.append(threading.Thread(target=_quiet, args=(
                subprocess.run, cmd), kwargs={"capture_output": True, "timeout": timeout}))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)


def _quiet(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - best effort at shutdown: the host may be gone
        pass


def _ended(process) -> tuple[bool, int | None]:
    """Whether a local launcher process (psutil.Process) ended, and its exit code if known."""
    import psutil

    try:
        if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            return False, None
        return True, process.wait(0)
    except (psutil.Error, ChildProcessError):
        return True, None


def _tail(path: str, lines: int = 40) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [x.rstrip() for x in f.readlines()[-lines:] if x.strip()]
    except OSError:
        return []


def _fatal_part(lines: list[str], keep: int = 12) -> list[str]:
    """From the first fatal line on (the traceback and the error), at most `keep` lines."""
    for i, line in enumerate(lines):
        if FATAL.search(line):
            return lines[i:][-keep:]
    return []


class EngineWatch:
    """Checks, while ranks start, whether the engines of other launchers failed.

    `check()` returns None while all looks well, else a message: what ended, the engines'
    last error lines, and the fix when one is known. Cheap checks (files, a local pid)
    run on every call; ssh and squeue at most every `remote_every` seconds.
    """

    def __init__(self, engine_sets, state_dir: str, remote_every: float = 1.5):
        self.engine_sets = list(engine_sets)
        self.state_dir = state_dir
        self.remote_every = remote_every
        self._next_remote = time.monotonic() + 0.5
        self._next_local = 0.0

    def check(self) -> str | None:
        now = time.monotonic()
        if now < self._next_local:
            return None
        self._next_local = now + 0.2
        for engine_set in self.engine_sets:
            message = self._check_set(engine_set, remote=now >= self._next_remote)
            if message:
                return message
        if now >= self._next_remote:
            self._next_remote = now + self.remote_every
        return None

    def _check_set(self, engine_set, remote: bool) -> str | None:
        name = type(engine_set).__name__
        if isinstance(engine_set, BatchSystemLauncher):
            lines = _tail(engine_set.output_file)
            fatal = _fatal_part(lines)
            if not fatal and remote and engine_set.job_id and not self._job_queued(engine_set):
                fatal = lines[-12:] or ["(the job wrote no output)"]
                return self._message(f"batch job {engine_set.job_id} ({name}) ended before "
                                     "its engines registered", fatal, engine_set.output_file)
            if fatal:
                return self._message(f"the engines of batch job {engine_set.job_id} ({name}) "
                                     "failed", fatal, engine_set.output_file)
            return None
        ssh_engines = _ssh_engines(engine_set)
        if ssh_engines:
            return self._check_ssh(ssh_engines) if remote else None
        if isinstance(engine_set, LocalProcessLauncher) and engine_set.process is not None:
            lines = _tail(engine_set.output_file)
            ended, code = _ended(engine_set.process)
            fatal = _fatal_part(lines)
            if ended:
                status = f"with status {code}" if code is not None else ""
                return self._message(
                    f"{os.path.basename(engine_set.args[0]) if engine_set.args else name} "
                    f"(pid {engine_set.pid}) exited {status} before every engine "
                    "registered", fatal or lines[-12:], engine_set.output_file)
            if fatal:
                return self._message(f"an engine started by {name} failed", fatal,
                                     engine_set.output_file)
        return None

    def _job_queued(self, engine_set) -> bool:
        try:
            out = subprocess.run(["squeue", "-h", "-j", str(engine_set.job_id), "-o", "%T"],
                                 capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return True  # cannot tell: do not call it failed
        state = out.stdout.strip()
        if out.returncode != 0:
            return "Invalid job id" not in out.stderr  # an error other than "gone": unknown
        return state in ("PENDING", "CONFIGURING", "RUNNING", "RESIZING", "SUSPENDED")

    def _check_ssh(self, ssh_engines) -> str | None:
        for el in ssh_engines:
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
            fatal = _fatal_part(lines)
            if not alive:
                return self._message(f"the engine on {el.location} (remote pid {el.pid}) "
                                     "exited before it registered", fatal or lines[-12:],
                                     f"{el.location}:{el.remote_output_file}")
            if fatal:
                return self._message(f"the engine on {el.location} failed", fatal,
                                     f"{el.location}:{el.remote_output_file}")
        return None

    def _message(self, what: str, lines: list[str], where: str) -> str:
        text = "\n".join(lines)
        fix = hint_for(text)
        return (f"{what}; the engines' last lines:\n{text}\n"
                + (f"Fix: {fix}\n" if fix else "")
                + f"(full output: {where}; logs: {self.state_dir}/profile/log)")
