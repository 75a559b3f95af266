"""Entry points of the processes a lab starts: `python -m tplab.rank.entry engine|controller ...`.

Both wrap ipyparallel's own entry points and add two things:
- an owner watch: when the notebook kernel that started the lab dies (even by SIGKILL),
  the process kills its own process group, so nothing outlives the notebook. A pid only
  means something on its own machine: engines that another launcher started (mpi, ssh,
  slurm; perhaps on other hosts) watch the controller's heartbeat instead, and exit when
  it has been silent for HEARTBEAT_LOST_S (the controller dies with the notebook);
- for engines, `import torch.distributed.tensor` in a background thread while the engine
  registers with the controller (the import is most of a rank's start-up time).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time

OWNER_ENV = "TPLAB_OWNER"  # "pid:start_time" of the notebook kernel that owns the lab
STATE_DIR_ENV = "TPLAB_STATE_DIR"  # the lab's private folder, removed when the owner dies
HEARTBEAT_ENV = "TPLAB_CONTROLLER_HB"  # tcp://host:port of the hub's heartbeat ping (PUB)
HEARTBEAT_LOST_S = 10.0  # the hub pings every 0.1-1 s (tplab/rank/heartbeat.py)
FIRST_ID_ENV = "TPLAB_FIRST_ID"  # MPI engines ask for engine id FIRST_ID + their MPI rank
POLL_S = 0.5


def process_start_time(pid: int) -> str | None:
    """When `pid` started (psutil's create_time), or None. Comparing it guards against a
    new process that reused the owner's pid."""
    # deferred: this module loads before the torch-warming thread starts (see _watch_heartbeat)
    import psutil

    try:
        return repr(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def boot_id() -> str:
    """This machine's boot id: the same on every process of one running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def owner_token(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{pid}:{process_start_time(pid) or ''}:{boot_id()}"


def owner_alive(token: str) -> bool:
    """Whether the process `token` (owner_token) names still runs. A zombie does not: a
    dead kernel that its parent has not reaped yet keeps its pid and start time (for as
    long as it stays a zombie, 90 s in one run), so its state ("Z", psutil's
    STATUS_ZOMBIE) is read too."""
    # deferred: this module loads before the torch-warming thread starts (see _watch_heartbeat)
    import psutil

    pid_s, _, start = token.partition(":")
    start = start.split(":", 1)[0]
    pid = int(pid_s)
    try:
        if psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        pass   # AccessDenied: no verdict from its state; the checks below decide
    if start:
        return process_start_time(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_owner(token: str) -> None:
    """Until the owner is gone (owner_alive); then remove the lab's state folder and end
    this process group."""
    while owner_alive(token):
        time.sleep(POLL_S)
    # The owner is gone: remove the lab's state folder (the owner cannot any more), then
    # end this process and the children it started (the engine's nanny, the controller's
    # schedulers), which share its process group.
    state_dir = os.environ.get(STATE_DIR_ENV)
    if state_dir and os.path.basename(state_dir).startswith("tplab-"):
        shutil.rmtree(state_dir, ignore_errors=True)
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


def _heartbeat_url(value: str, wait_s: float = 60.0) -> str | None:
    """A tcp:// address as given, or ("connection-file") the hub's heartbeat ping from the
    engine connection file ipyparallel gives every engine (in $IPP_PROFILE_DIR/security)."""
    if value.startswith("tcp://"):
        return value
    path = os.path.join(os.environ.get("IPP_PROFILE_DIR", ""), "security",
                        f"ipcontroller-{os.environ.get('IPP_CLUSTER_ID', '')}-engine.json")
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"[tplab] no connection file {path}: not watching the controller",
                  file=sys.stderr)
            return None
        time.sleep(0.2)
    with open(path) as f:
        info = json.load(f)
    host = info["interface"].split("://", 1)[-1]
    if host in ("*", "0.0.0.0", ""):
        host = info.get("location") or "127.0.0.1"
    return f"tcp://{host}:{info['hb_ping']}"


def _watch_heartbeat(url: str) -> None:
    """Exit (with every child) when the controller's heartbeat ping has been silent for
    HEARTBEAT_LOST_S: the controller is gone, so is the notebook. ipyparallel's own
    engine check runs on the engine's event loop, which a busy cell blocks; this thread
    does not wait for the cell."""
    # deferred: this module loads in 0.02 s, before the torch-warming thread starts (main);
    # zmq and psutil would add 0.05 s to that (python -X importtime -c 'import tplab.rank.entry')
    import psutil
    import zmq

    url = _heartbeat_url(url)
    if url is None:
        return
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(url)
    last = time.monotonic()
    while time.monotonic() - last < HEARTBEAT_LOST_S:
        if sub.poll(500):
            while sub.poll(0):
                sub.recv_multipart()
            last = time.monotonic()
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(1)


def _start_owner_watch(role: str = "engine") -> None:
    token = os.environ.get(OWNER_ENV)
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    if role == "engine" and heartbeat:
        threading.Thread(target=_watch_heartbeat, args=(heartbeat,), daemon=True,
                         name="tplab-heartbeat-watch").start()
    elif token and token.rsplit(":", 1)[-1] in (boot_id(), ""):  # the owner is on this machine
        threading.Thread(target=watch_owner, args=(token,), daemon=True,
                         name="tplab-owner-watch").start()


def _warm_torch() -> None:
    # deferred: the point of this thread: torch loads while the engine registers (docs/DESIGN.md,
    # "Facts measured here": 0.88x of the floor; benchmarks/launch.py)
    import torch.distributed.tensor  # noqa: F401


OUTPUT_DIR = "output"  # in the lab's state folder: what each rank wrote to fds 1 and 2


def output_paths(state_dir: str, pid: int) -> tuple[str, str]:
    """The files that hold everything rank process `pid` wrote to its stdout and stderr."""
    folder = os.path.join(state_dir, OUTPUT_DIR)
    return os.path.join(folder, f"{pid}.out"), os.path.join(folder, f"{pid}.err")


def _capture_output() -> None:
    """Point fds 1 and 2 at two files of this rank's own, which the notebook reads as they
    grow (tplab/lab/streams.py). Everything written below Python lands there too: os.write,
    subprocesses, C++ warnings, threads, and faulthandler's crash report; a file outlives a
    crash, so nothing printed is lost. ipyparallel's own log keeps the process's old stderr.
    """
    state_dir = os.environ.get(STATE_DIR_ENV) or "/tmp"
    out_path, err_path = output_paths(state_dir, os.getpid())
    os.makedirs(os.path.dirname(out_path), mode=0o700, exist_ok=True)
    log = os.fdopen(os.dup(2), "w", buffering=1)
    for fd, path in ((1, out_path), (2, err_path)):
        # read-write: ranks elsewhere read their own output back (rank.py forwards it)
        target = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = log  # until the engine takes over the streams: its log goes to the log
    sys.__stderr__ = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.__stdout__ = sys.stdout


def _nanny_logs_to_the_log() -> None:
    """ipyparallel's nanny (with fork=False) inherits fd 2, which is the rank's own output
    now: start it with the process's log as its stderr instead, so that its log lines
    are not shown as the rank's output."""
    # deferred: ipyparallel's engine (0.3 s) loads after the torch-warming thread has started,
    # so that the two overlap (main); the controller and the fork server load neither
    from ipyparallel.engine import nanny

    nanny.Popen = functools.partial(nanny.Popen, stderr=sys.stderr.fileno())


def _run_engine(argv: list[str]) -> None:
    _capture_output()
    if "--IPEngine.enable_nanny=False" not in argv:
        _nanny_logs_to_the_log()
    stream = "--IPEngine.out_stream_factory=tplab.rank.stream.RankStream"
    sys.argv = ["tplab-engine", *argv, stream]
    # deferred: as in _nanny_logs_to_the_log: after the torch-warming thread has started
    from ipyparallel.engine.app import main as ipengine

    ipengine()


def _zygote() -> None:
    """A fork server: import torch and the engine once, then fork engines on request.

    Reads JSON lines {"argv": [...], "env": {...}, "log": path} on stdin; writes
    {"pid": n} for each fork and {"exited": pid, "code": c} when a child ends (the code
    as subprocess reports it: negative for a signal). Forking before any CUDA call is
    safe; nothing here touches CUDA.
    """
    # deferred: only the fork server loads torch and the engine before it forks; an engine
    # and the controller must not pay for it before they start (main)
    import torch.distributed.tensor  # noqa: F401
    from ipyparallel.engine import app  # noqa: F401

    out_lock = threading.Lock()

    def say(message: dict) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.05)
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            say({"exited": pid, "code": code})

    threading.Thread(target=reap, daemon=True, name="tplab-reaper").start()
    say({"ready": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid:
            say({"pid": pid})
            continue
        try:  # the child: a new rank process
            os.setsid()
            random.seed()
            os.environ.update(request["env"])
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            sys.stdin = open(os.devnull)  # noqa: SIM115
            _start_owner_watch()
            _run_engine(request["argv"])
        finally:
            os._exit(0)
    os._exit(0)  # stdin closed: the lab that owns this fork server is gone


def _mpi_engine_id(argv: list[str]) -> list[str]:
    """Each start of the ranks gets engine ids of its own: FIRST_ID + MPI rank (ipyparallel
    would ask for the MPI rank itself, still taken until the hub drops the old ranks, and
    delay registering by id * mpi_registration_delay)."""
    from mpi4py import MPI  # ipyparallel's MPI engines need it: pip install "tplab[mpi]"

    engine_id = int(os.environ[FIRST_ID_ENV]) + MPI.COMM_WORLD.Get_rank()
    return [*argv, f"--IPEngine.id={engine_id}", "--IPEngine.mpi_registration_delay=0"]


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("engine", "controller", "zygote"):
        raise SystemExit("usage: python -m tplab.rank.entry engine|controller|zygote [args]")
    role, rest = argv[0], argv[1:]
    if role == "engine" and "--mpi" in rest and os.environ.get(FIRST_ID_ENV):
        rest = _mpi_engine_id(rest)  # first: MPI_Init before any other thread runs
    _start_owner_watch(role)
    if role == "engine":
        # (after MPI_Init: Open MPI's initialisation racing torch's import in another thread
        # hung engines on other hosts now and then)
        threading.Thread(target=_warm_torch, daemon=True, name="tplab-warm-torch").start()
        _run_engine(rest)
    elif role == "zygote":
        _zygote()
    else:
        sys.argv = ["tplab-controller", *rest]
        # deferred: the controller's own entry point, loaded by the controller only
        from ipyparallel.controller.app import main as ipcontroller

        from tplab.rank import heartbeat

        heartbeat.pace()
        ipcontroller()


if __name__ == "__main__":
    main(sys.argv[1:])
