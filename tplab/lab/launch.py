"""`tplab.launch`: start N rank processes from a notebook and run code on them SPMD.

Built on ipyparallel (a controller plus one engine per rank), so its other engine
launchers (mpi, slurm, ssh...) are a parameter away: `tplab.launch(8, engines="mpi")`.
One `Lab` object owns the processes' whole life: start, restart, shutdown.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import weakref

import ipyparallel as ipp
from traitlets.config import Config

from tplab import platforms
from tplab.errors import LabError
from tplab.lab import engines as other_engines
from tplab.lab import joining, network, processes
from tplab.lab import rank as rank_side
from tplab.lab.cells import Cells
from tplab.lab.entry import FIRST_ID_ENV, OWNER_ENV, STATE_DIR_ENV, owner_token
from tplab.lab.names import RankNames
from tplab.lab.validate import (
    check_launch_args,
    check_threads,
    check_timeout,
    resolve_backend,
    split_cluster_options,
)
from tplab.lab.watchdog import Watchdog, deferred_interrupts

_log = logging.getLogger("tplab.ipyparallel")
_log.setLevel(logging.ERROR)  # keep ipyparallel's log noise out of notebook outputs
_log.propagate = False
_log.addHandler(logging.StreamHandler(sys.stderr))

DEFAULT_TIMEOUT_S = 60.0  # a cell that runs longer than this in a workshop is a hang
ENGINE_IDS_PER_START = 1024  # start g of the ranks asks the hub for ids g*1024 + rank


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Lab(Cells):
    """N rank processes, each an ipyparallel engine with torch.distributed initialised.

    Use `tplab.launch(...)` to make one. `run`, `execute`, `push` and `pull` return one
    item per rank, in rank order. See docs/DESIGN.md for the whole contract.
    """

    def __init__(self, world_size: int = 4, backend: str = "auto", engines: str = "local",
                 timeout: float | None = None, cell_timeout: float | None = None,
                 ip: str = "127.0.0.1", threads_per_rank: int | None = None,
                 fork: bool | None = None, master_addr: str | None = None,
                 cluster_options: dict | None = None,
                 **more_cluster_options):
        # The fork server is the default on Linux only: on macOS forking after torch is
        # imported crashes the child (tplab/platforms.py says why).
        fork = platforms.default_fork() if fork is None else fork
        check_launch_args(world_size, backend, engines, ip, fork)
        if cluster_options is not None and not isinstance(cluster_options, dict):
            raise TypeError(f"cluster_options must be a dict of ipyparallel.Cluster options, "
                            f"got {type(cluster_options).__name__}")
        self._cluster_options = split_cluster_options(
            {**(cluster_options or {}), **more_cluster_options})
        self.world_size = world_size
        # Local ranks: decided here. Ranks elsewhere (mpi, slurm...) decide "auto" themselves.
        self.backend = resolve_backend(backend, world_size) if engines == "local" else backend
        self.engines = engines
        self.timeout = check_timeout(timeout, "timeout") or DEFAULT_TIMEOUT_S
        self.cell_timeout = check_timeout(cell_timeout, "cell_timeout")
        self.ip = ip
        self.threads_per_rank = check_threads(threads_per_rank) or max(
            1, (os.cpu_count() or 1) // world_size)
        # Where rank 0's rendezvous store listens: the lab's ip, or this host's name when
        # the lab listens on every interface (so that ranks elsewhere can reach it).
        self._master_addr = master_addr or (
            ip if ip not in ("0.0.0.0", "*", "") else socket.gethostname())
        self._master_addr_given = master_addr is not None  # else: rank 0's, for remote ranks
        self._engine_watch = None
        self.fork = fork  # local ranks forked from a process that imported torch once
        self._fork_server = None
        self._cells = itertools.count(1)
        self._starts = itertools.count(1)  # how many times ranks were started
        self._generation = 0
        self._cluster = self._client = None
        self._engine_ids: list[int] = []  # ipyparallel engine id of each rank, in rank order
        self._view = None  # a DirectView on every rank, made once per set of ranks
        self._closed = False
        self._broken = ""  # why the ranks need a restart before the next cell (or "")
        self.names = RankNames(world_size)  # which names each rank defines itself
        self._state_dir = tempfile.mkdtemp(prefix="tplab-")  # mode 0700: owner only
        self._finalizer = weakref.finalize(self, Lab._cleanup, self._state_holder())
        self.processes = processes.RankProcesses()
        self.watchdog = Watchdog(world_size, self.processes, self._send, self._restart_ranks,
                                 self.names.lost)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    @property
    def closed(self) -> bool:
        """True once the lab was shut down."""
        return self._closed

    @property
    def state_dir(self) -> str:
        """The lab's private folder (mode 0700): logs, the ranks' output files."""
        return self._state_dir

    @property
    def rank_pids(self) -> list[int]:
        """The pid of each rank process, in rank order."""
        return list(self.processes.pids)

    # --- life ------------------------------------------------------------------------

    def _state_holder(self) -> dict:
        # What a finalizer needs to end the processes, without a reference to self.
        self._holder = {"roots": [], "extra_roots": [], "state_dir": self._state_dir,
                        "cluster": None, "engine_sets": []}
        return self._holder

    def _start(self) -> None:
        started = time.monotonic()
        env = {
            OWNER_ENV: owner_token(),
            STATE_DIR_ENV: self._state_dir,
            "IPYTHONDIR": os.path.join(self._state_dir, "ipython"),
            "OMP_NUM_THREADS": str(self.threads_per_rank),
            "PYTHONUNBUFFERED": "1",
        }
        if self.ip.startswith("127."):  # gloo on loopback, not the hostname's address
            env.update(platforms.rank_env())
        config = Config()
        config.BaseLauncher.environment = env
        python = platforms.engine_python()  # the kernel's own Python (JupyterHub, venvs)
        config.EngineLauncher.engine_cmd = [python, "-m", "tplab.lab.entry", "engine"]
        config.ControllerLauncher.controller_cmd = [
            python, "-m", "tplab.lab.entry", "controller"]
        config.LocalEngineSetLauncher.delay = 0.0
        if self.engines != "local":
            other_engines.configure(config, self.engines, env, self._state_dir)
        engines = self.engines
        if self.engines == "ssh":  # ipyparallel's, starting every host at once
            engines = other_engines.SSHEngineSetLauncherByHost
        if self.engines == "local":
            engines = processes.ForkedEngineSetLauncher if self.fork else processes.RankSetLauncher
        if self.engines == "local" and self.fork:
            # Start the fork server first: its torch import overlaps the controller's start.
            log_dir = os.path.join(self._state_dir, "profile", "log")
            os.makedirs(log_dir, exist_ok=True)
            self._fork_server = processes.ForkServer(env, os.path.join(log_dir, "zygote.log"))
            self._holder["extra_roots"] = [self._fork_server.pid]
        options = dict(
            n=self.world_size, engines=engines, controller_ip=self.ip,
            controller_args=["--HeartMonitor.period=100", "--log-level=ERROR"],
            profile_dir=os.path.join(self._state_dir, "profile"), cluster_id="tplab",
            cluster_file="",  # not needed: this Lab object is the only handle on the cluster
            delay=0.0, send_engines_connection_env=False, shutdown_atexit=False,
            load_profile=False, log=_log, config=config,
        )
        options.update(self._cluster_options)
        if "config" in self._cluster_options:  # the user's settings win, the lab's stay
            config.merge(Config(self._cluster_options["config"]))
            options["config"] = config
        self._engine_env = {**env, **dict(config.BaseLauncher.environment)}
        self._cluster = self._holder["cluster"] = ipp.Cluster(**options)
        self._cluster.start_controller_sync()
        self._remember_roots()
        if self._fork_server is not None:
            self._fork_server.wait_ready(timeout=max(60.0, self.timeout))
        self._start_ranks()
        self.startup_s = time.monotonic() - started

    def _start_ranks(self) -> None:
        cluster = self._cluster
        self._generation = next(self._starts)
        first_id = self._generation * ENGINE_IDS_PER_START
        extra = {"fork_server": self._fork_server} if self._fork_server is not None else {}
        if self.engines == "local":
            extra["first_id"] = first_id
        if self.engines == "mpi":  # engine id = first_id + MPI rank (entry.py)
            extra["environment"] = {**self._engine_env, FIRST_ID_ENV: str(first_id)}
        before = set(self._client.ids) if self._client is not None else set()
        try:
            engine_set_id = cluster.start_engines_sync(self.world_size, **extra)
        except Exception as exc:
            if self.engines == "local":
                raise
            raise other_engines.start_error(self.engines, exc, self._state_dir) from None
        self.processes.reset([cluster.engines[engine_set_id]])
        self._remember_roots()
        if self.engines != "local":
            self._engine_watch = other_engines.EngineWatch(
                [cluster.engines[engine_set_id]], self._state_dir)
        if self._client is None:
            self._client = cluster.connect_client_sync()
        if self.engines in ("local", "mpi"):
            wanted = [first_id + r for r in range(self.world_size)]
        else:  # other launchers pick their own ids: take the new ones
            wanted = None
        wait = joining.StartWait(self._start_limit_s(), self._starting_pids)
        while True:
            ids = set(self._client.ids)
            if wanted is not None and ids.issuperset(wanted):
                self._engine_ids = wanted
                break
            new = sorted(ids - before)
            if wanted is None and len(new) >= self.world_size:
                self._engine_ids = new[:self.world_size]
                break
            if wait.expired():
                raise LabError(
                    f"only {len(ids - before)} of {self.world_size} ranks started within "
                    f"{wait.elapsed:.0f} s; the engines' logs are in "
                    f"{self._state_dir}/profile/log")
            self._fail_if_a_rank_exited()
            time.sleep(0.01)
        self._init_ranks()
        self._engine_watch = None  # started: what engines log from now on is the user's

    def _init_ranks(self) -> None:
        port = _free_port(self.ip if self.ip != "0.0.0.0" else "127.0.0.1")
        self.master_addr, self.master_port = self._master_addr, port
        forward = self.engines != "local"
        if forward:  # ranks elsewhere: the store on rank 0's host, gloo on the route to it
            if not self._master_addr_given:
                controller = self.ip if self.ip not in ("0.0.0.0", "*") else socket.gethostname()
                where = self._wait_for_init([self._client[self._engine_ids[0]].apply_async(
                    network.rank_address, controller)])[0]
                self.master_addr, port = where["address"], where["port"]
                self.master_port = port
            self._wait_for_init([self._client[eid].apply_async(
                network.point_gloo_at, self.master_addr) for eid in self._engine_ids])
        ars = [
            self._client[eid].apply_async(
                rank_side.init_rank, r, self.world_size, self.backend, self.master_addr, port,
                self.threads_per_rank, r if self.engines == "local" else None, 120.0, forward)
            for r, eid in enumerate(self._engine_ids)
        ]
        infos = self._wait_for_init(ars)
        self.processes.pids = [info["pid"] for info in infos]
        self.processes.local = self.engines == "local"
        self.processes.signal_remote = lambda ranks, sig: self._client.send_signal(
            sig, targets=[self._engine_ids[r] for r in ranks], block=False)
        host = socket.gethostname()
        for r, info in enumerate(infos):
            if info["host"] == host and not forward:
                self.processes.files.attach(r, *info["output"])
        self.names.reset()
        self.master_port = port
        self.watchdog.connect_store(self.master_addr, port)

    def _start_limit_s(self) -> float:
        """How long ranks may take to register and join: 8 s per rank per core, counting
        the machine's other busy processes (a room of labs starting at once), at least
        60 s or the lab's timeout; stretched while the ranks still use CPU (joining.py)."""
        return joining.start_limit_s(self.world_size, self.timeout)

    def _starting_pids(self) -> list[int]:
        """The rank processes being started, in rank order (local engines only)."""
        return list(self.processes.exit_codes()) if self.engines == "local" else []

    def _wait_for_init(self, ars: list) -> list[dict]:
        wait = joining.StartWait(self._start_limit_s(), self._starting_pids)
        infos = []
        for r, ar in enumerate(ars):
            while not ar.ready():
                self._fail_if_a_rank_exited()
                if wait.expired():
                    raise LabError(joining.join_report(
                        r, self._starting_pids(), self._state_dir, self.backend,
                        self.master_addr, self.master_port, wait.elapsed, self.world_size))
                ar.wait(0.05)
            try:
                infos.append(ar.get(0))
            except ipp.error.RemoteError as exc:
                detail = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(exc.render_traceback()))
                raise LabError(f"rank {r} could not join the process group "
                               f"({self.backend}):\n{detail}") from None
        return infos

    def _fail_if_a_rank_exited(self) -> None:
        failed = self._engine_watch.check() if self._engine_watch is not None else None
        if failed:
            raise LabError(f"the engines ({self.engines!r}) failed to start: {failed}")
        dead = self.processes.dead()
        if dead:
            pid = next(p for p, c in self.processes.exit_codes().items() if c is not None)
            log = self._state_dir + "/profile/log"
            tail = processes.log_tail(log, pid)
            raise LabError(f"a rank process exited while starting ({next(iter(dead.values()))})"
                           f"; its last lines:\n{tail}\n(logs: {log}, {self._state_dir}/output)")

    def _remember_roots(self) -> None:
        roots = []
        controller = self._cluster.controller if self._cluster else None
        if controller is not None and getattr(controller, "pid", -1) > 0:
            roots.append(controller.pid)
        engine_sets = list(self._cluster.engines.values()) if self._cluster else []
        for engine_set in engine_sets:
            roots += other_engines.local_pids(engine_set)  # never a pid on another host
        self._holder["roots"] = roots
        self._holder["engine_sets"] = engine_sets

    @property
    def pids(self) -> list[int]:
        """Every process this lab started and that is still running: the controller and
        its schedulers, the fork server, every rank (and its nanny, where ipyparallel
        starts one). Ranks that another launcher started are here only as descendants of
        a local launcher process (mpiexec): a pid on another host means nothing here."""
        ranks = self.processes.pids if self.engines == "local" else []
        return processes.tree(self._holder["roots"] + self._holder["extra_roots"] + ranks)

    def restart(self) -> float:
        """Start fresh rank processes (same settings, same controller); returns seconds.
        Names defined on the ranks are gone afterwards."""
        self._check_open()
        return self._restart_ranks()

    def _restart_ranks(self) -> float:
        """End every rank process, then start fresh ones. An interrupt in the middle is
        held back until the ranks are consistent again; if the start itself fails, the
        lab is marked broken and the next cell (or restart()) starts over."""
        started = time.monotonic()
        with deferred_interrupts() as held:
            self._broken = "the last restart did not finish"
            self.watchdog.disconnect_store()
            other_engines.stop_remote(self._holder["engine_sets"])  # ssh engines, batch jobs
            old = [pid for pid in self._holder["roots"] if pid != self._controller_pid()]
            ranks = self.processes.pids if self.engines == "local" else []  # pids elsewhere
            processes.kill_trees(old + ranks, timeout=0)  # they die on their own
            for set_id in list(self._cluster.engines):
                self._cluster.engines.pop(set_id)
            self.processes.reset([])
            self._view = None
            self.names.clear()
            self._start_ranks()
            self._broken = ""
        if held.pressed:
            raise KeyboardInterrupt
        return time.monotonic() - started

    def _controller_pid(self) -> int:
        controller = self._cluster.controller
        return getattr(controller, "pid", -1) if controller is not None else -1

    def shutdown(self) -> None:
        """End every process the lab started and remove its state directory."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.disconnect_store()
        if self._client is not None:
            try:
                self._client.close(linger=0)
            except Exception:
                pass
        self._finalizer()

    @staticmethod
    def _cleanup(holder: dict) -> None:
        other_engines.stop_remote(holder.get("engine_sets", []))  # ssh engines, batch jobs
        processes.kill_trees(holder["roots"] + holder["extra_roots"])
        cluster = holder.get("cluster")
        if cluster is not None:
            cluster.engines.clear()
            cluster.controller = None
        shutil.rmtree(holder["state_dir"], ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this lab was shut down; start a new one with tplab.launch(...)")

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"{len(self.processes.pids)} ranks running"
        return (f"<tplab.Lab world_size={self.world_size} backend={self.backend!r} "
                f"engines={self.engines!r}: {state}>")

def launch(world_size: int = 4, backend: str = "auto", engines: str = "local",
           timeout: float | None = None, **cluster_options) -> Lab:
    """Start `world_size` ranks and return the `Lab` that owns them.

    backend: "auto" (NCCL with one GPU per rank when there are enough GPUs, else gloo),
    "gloo" or "nccl". engines: "local" or another ipyparallel engine launcher ("mpi",
    "slurm", "ssh", ...; pass ip="0.0.0.0" so remote engines can connect). timeout:
    seconds a cell may run before tplab reports a hang (default 60).
    """
    lab = Lab(world_size, backend=backend, engines=engines, timeout=timeout, **cluster_options)
    from tplab.lab.magics import register_magics

    register_magics(lab)
    return lab

