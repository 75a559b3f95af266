"""Watching engines of other launchers while they start, and what their errors mean.

- `EngineWatch`: a start failure reported within seconds, with the engines' own last error
  lines and the fix; what "failed" means is the engine kind's (`EngineKind.check`): the
  launcher process exited (mpiexec), the batch job left the queue (Slurm), a remote engine
  process is gone (ssh), or an engine log has a fatal line;
- `start_error`: a launcher that fails at once (sbatch, ssh or mpiexec refused);
- `hint_for`: the fix for what the engines said.
See docs/CLUSTER.md, and ipyparallel's launchers (ipyparallel.cluster.launcher).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import psutil

from tplab.errors import LabError

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
     "'tplab.rank.entry', 'engine']}}}"),
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


def submit_errors(state_dir: str) -> str:
    """Where the batch submit command's error output goes (the lab's log folder)."""
    return os.path.join(state_dir, "profile", "log", "submit.err")


def start_error(engines, exc: BaseException, state_dir: str) -> LabError:
    """A LabError for a launcher that could not even start its engines (sbatch, ssh or
    mpiexec failed at once), with what the command said and the fix."""
    first = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, subprocess.CalledProcessError):
        cmd = [str(c) for c in (exc.cmd if isinstance(exc.cmd, list) else [exc.cmd])]
        if cmd[:2] == ["sh", "-c"] and "sbatch" in cmd[2]:  # configure()'s wrapper
            cmd = ["sbatch", *cmd[4:]]
        first = f"`{' '.join(cmd)}` exited with status {exc.returncode}"
    parts = [first, getattr(exc, "output", None), getattr(exc, "stderr", None),
             "\n".join(tail(submit_errors(state_dir)))]
    said = "\n".join(p.decode(errors="replace") if isinstance(p, bytes) else str(p)
                     for p in parts if p)
    fix = hint_for(said)
    return LabError(f"the engines ({engines!r}) could not be started: {said.strip()}\n"
                    + (f"Fix: {fix}\n" if fix else "")
                    + f"(logs: {state_dir}/profile/log)")


def hint_for(text: str) -> str:
    """The fix for what the engines said, or "" when none is known."""
    for pattern, fix in HINTS:
        if pattern.search(text):
            return fix
    return ""


def ended(process) -> tuple[bool, int | None]:
    """Whether a local launcher process (psutil.Process) ended, and its exit code if known."""
    try:
        if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            return False, None
        return True, process.wait(0)
    except (psutil.Error, ChildProcessError):
        return True, None


def tail(path: str, lines: int = 40) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [x.rstrip() for x in f.readlines()[-lines:] if x.strip()]
    except OSError:
        return []


def fatal_part(lines: list[str], keep: int = 12) -> list[str]:
    """From the first fatal line on (the traceback and the error), at most `keep` lines."""
    for i, line in enumerate(lines):
        if FATAL.search(line):
            return lines[i:][-keep:]
    return []




def message(what: str, lines: list[str], where: str, state_dir: str) -> str:
    """What failed, the engines' last lines, the fix when one is known, where to look."""
    text = "\n".join(lines)
    fix = hint_for(text)
    return (f"{what}; the engines' last lines:\n{text}\n"
            + (f"Fix: {fix}\n" if fix else "")
            + f"(full output: {where}; logs: {state_dir}/profile/log)")


class EngineWatch:
    """Checks, while ranks start, whether the engines failed (the kind says how).

    `check()` returns None while all looks well, else a message: what ended, the engines'
    last error lines, and the fix when one is known. Cheap checks (files, a local pid)
    run on every call; remote ones (ssh, squeue) at most every `remote_every` seconds.
    """

    def __init__(self, kind, engine_sets, state_dir: str, remote_every: float = 1.5):
        self.kind = kind
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
        remote = now >= self._next_remote
        for engine_set in self.engine_sets:
            said = self.kind.check(engine_set, remote, self.state_dir)
            if said:
                return said
        if remote:
            self._next_remote = now + self.remote_every
        return None
