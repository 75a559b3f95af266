"""`tplab.launch`: start N rank processes from a notebook and run code on them SPMD.

Built on ipyparallel (a controller plus one engine per rank), so its other engine
launchers (mpi, slurm, ssh...) are a parameter away: `tplab.launch(8, engines="mpi")`.
One `Lab` object owns the processes' whole life: start, restart, shutdown.
"""

from __future__ import annotations

import itertools
import linecache
import logging
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import time
import weakref

import cloudpickle
import ipyparallel as ipp
from traitlets.config import Config

from tplab.errors import LabError
from tplab.lab import processes
from tplab.lab import rank as rank_side
from tplab.lab.entry import OWNER_ENV, STATE_DIR_ENV, owner_token
from tplab.lab.validate import check_launch_args, check_timeout, resolve_backend
from tplab.lab.watchdog import RankResults, Watchdog

_log = logging.getLogger("tplab.ipyparallel")
_log.setLevel(logging.ERROR)  # keep ipyparallel's log noise out of notebook outputs
_log.propagate = False
_log.addHandler(logging.StreamHandler(sys.stderr))

_STDLIB = sysconfig.get_paths()["stdlib"]
DEFAULT_TIMEOUT_S = 60.0  # a cell that runs longer than this in a workshop is a hang
_IPP_LOG_MARKS = ("[IPEngine", "[IPKernelApp]", "[KernelNanny]")  # ipyparallel's own lines


def _loopback_interface() -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Lab:
    """N rank processes, each an ipyparallel engine with torch.distributed initialised.

    Use `tplab.launch(...)` to make one. `run`, `execute`, `push` and `pull` return one
    item per rank, in rank order. See docs/DESIGN.md for the whole contract.
    """

    def __init__(self, world_size: int = 4, backend: str = "auto", engines: str = "local",
                 timeout: float | None = None, ip: str = "127.0.0.1",
                 threads_per_rank: int | None = None, fork: bool = True,
                 master_addr: str | None = None, **cluster_options):
        check_launch_args(world_size, backend, engines, ip)
        self.world_size = world_size
        # Local ranks: decided here. Ranks elsewhere (mpi, slurm...) decide "auto" themselves.
        self.backend = resolve_backend(backend, world_size) if engines == "local" else backend
        self.engines = engines
        self.timeout = check_timeout(timeout, "timeout") or DEFAULT_TIMEOUT_S
        self.ip = ip
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._cluster_options = cluster_options  # passed on to ipyparallel.Cluster
        # Where rank 0's rendezvous store listens: the lab's ip, or this host's name when
        # the lab listens on every interface (so that ranks elsewhere can reach it).
        self._master_addr = master_addr or (
            ip if ip not in ("0.0.0.0", "*", "") else socket.gethostname())
        self.fork = fork  # local ranks forked from a process that imported torch once
        self._fork_server = None
        self._cells = itertools.count(1)
        self._cluster = self._client = None
        self._rank_pids: list[int] = []
        self._engine_ids: list[int] = []  # ipyparallel engine id of each rank, in rank order
        self._dead_engine_ids: list[int] = []  # ids of ended ranks the hub may still list
        self._view = None  # a DirectView on every rank, made once per set of ranks
        self._closed = False
        self._state_dir = tempfile.mkdtemp(prefix="tplab-")  # mode 0700: owner only
        self._finalizer = weakref.finalize(self, Lab._cleanup, self._state_holder())
        self.watchdog = Watchdog(self)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # --- life ------------------------------------------------------------------------

    def _state_holder(self) -> dict:
        # What a finalizer needs to end the processes, without a reference to self.
        self._holder = {"roots": [], "extra_roots": [], "state_dir": self._state_dir,
                        "cluster": None}
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
        loopback = _loopback_interface() if self.ip.startswith("127.") else None
        if loopback:
            env["GLOO_SOCKET_IFNAME"] = loopback  # gloo would bind to the hostname's address
        config = Config()
        config.BaseLauncher.environment = env
        config.EngineLauncher.engine_cmd = [sys.executable, "-m", "tplab.lab.entry", "engine"]
        config.ControllerLauncher.controller_cmd = [
            sys.executable, "-m", "tplab.lab.entry", "controller"]
        config.LocalEngineSetLauncher.delay = 0.0
        engines = self.engines
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
        self._cluster = self._holder["cluster"] = ipp.Cluster(**options)
        self._cluster.start_controller_sync()
        self._remember_roots()
        if self._fork_server is not None:
            self._fork_server.wait_ready(timeout=max(60.0, self.timeout))
        self._start_ranks()
        self.startup_s = time.monotonic() - started

    def _start_ranks(self) -> None:
        cluster = self._cluster
        extra = {"fork_server": self._fork_server} if self._fork_server is not None else {}
        cluster.start_engines_sync(self.world_size, **extra)
        self._remember_roots()
        if self._client is None:
            self._client = cluster.connect_client_sync()
        deadline = time.monotonic() + max(60.0, self.timeout)
        while len(set(self._client.ids) - set(self._dead_engine_ids)) < self.world_size:
            if time.monotonic() > deadline:
                raise LabError(
                    f"only {len(self._client.ids)} of {self.world_size} ranks started within "
                    f"{max(60.0, self.timeout):.0f} s; the engines' logs are in "
                    f"{self._state_dir}/profile/log")
            self._check_engines_alive(starting=True)
            time.sleep(0.01)
        self._engine_ids = sorted(set(self._client.ids) - set(self._dead_engine_ids))
        self._init_ranks()

    def _init_ranks(self) -> None:
        port = _free_port(self.ip if self.ip != "0.0.0.0" else "127.0.0.1")
        self.master_addr, self.master_port = self._master_addr, port
        ars = [
            self._client[eid].apply_async(
                rank_side.init_rank, r, self.world_size, self.backend, self.master_addr, port,
                self.threads_per_rank, r if self.engines == "local" else None)
            for r, eid in enumerate(self._engine_ids)
        ]
        self._rank_pids = self.watchdog.wait_for_init(ars)
        self.watchdog.connect_store(self.master_addr, port)

    def _remember_roots(self) -> None:
        roots = []
        controller = self._cluster.controller if self._cluster else None
        if controller is not None and getattr(controller, "pid", -1) > 0:
            roots.append(controller.pid)
        for engine_set in (self._cluster.engines.values() if self._cluster else []):
            for el in getattr(engine_set, "launchers", {}).values():
                if el.pid > 0:
                    roots.append(el.pid)
        self._holder["roots"] = roots

    @property
    def pids(self) -> list[int]:
        """Every process this lab started and that is still running: the controller and
        its schedulers, the fork server, every rank (and its nanny, where ipyparallel
        starts one)."""
        return processes.tree(self._holder["roots"] + self._holder["extra_roots"]
                              + self._rank_pids)

    def _check_engines_alive(self, starting: bool = False) -> dict[int, str]:
        """rank -> how it ended, for every rank process that is gone."""
        dead = {}
        for engine_set in self._cluster.engines.values():
            codes = engine_set.exit_codes() if hasattr(engine_set, "exit_codes") else {}
            for pid, code in codes.items():
                if code is not None:
                    rank = self._rank_pids.index(pid) if pid in self._rank_pids else -1
                    dead[rank] = processes.how_it_ended(code)
        if starting and dead:
            raise LabError(f"a rank process exited while starting ({dead[next(iter(dead))]});"
                           f" its log is in {self._state_dir}/profile/log")
        return dead

    def _rank_log_tail(self, rank: int, lines: int = 15) -> str:
        pid = self._rank_pids[rank] if rank < len(self._rank_pids) else None
        for engine_set in self._cluster.engines.values():
            for el in getattr(engine_set, "launchers", {}).values():
                if el.pid == pid and os.path.exists(el.output_file):
                    with open(el.output_file, errors="replace") as f:
                        # The rank's own output and crash report, not ipyparallel's log.
                        mine = [x for x in f if not any(p in x for p in _IPP_LOG_MARKS)]
                    crash = next((i for i, x in enumerate(mine) if x.startswith("Fatal Python")),
                                 None)
                    if crash is not None:  # faulthandler's report: the crashing stack first
                        return "".join(mine[max(0, crash - 3):crash + lines]).rstrip()
                    return "".join(mine[-lines:]).rstrip()
        return ""

    def restart(self) -> float:
        """Start fresh rank processes (same settings, same controller); returns seconds."""
        self._check_open()
        started = time.monotonic()
        self.watchdog.disconnect_store()
        old = [pid for pid in self._holder["roots"] if pid != self._controller_pid()]
        processes.kill_trees(old + self._rank_pids, timeout=0)  # they die on their own time
        self._dead_engine_ids += self._engine_ids
        for set_id in list(self._cluster.engines):
            self._cluster.engines.pop(set_id)
        self._rank_pids, self._view = [], None
        self._start_ranks()
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
        state = "shut down" if self._closed else f"{len(self._rank_pids)} ranks running"
        return (f"<tplab.Lab world_size={self.world_size} backend={self.backend!r} "
                f"engines={self.engines!r}: {state}>")

    # --- work ------------------------------------------------------------------------

    def _dumps(self, obj, what: str) -> bytes:
        try:
            return cloudpickle.dumps(obj)
        except Exception as exc:
            raise TypeError(f"{what} cannot be sent to the ranks: {type(exc).__name__}: {exc}. "
                            "Define it in the notebook or an importable module, and pass "
                            "plain data (tensors, numbers, lists) as arguments.") from exc

    def _ranks(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks must be rank numbers from 0 to {self.world_size - 1}, "
                             f"got {ranks!r}")
        return sorted(set(ranks))

    def run(self, fn, *args, timeout: float | None = None, ranks=None, **kwargs) -> list:
        """Call fn(*args, **kwargs) on every rank (or on `ranks`); item r is rank r's result."""
        if not callable(fn):
            raise TypeError(f"lab.run needs a function as its first argument, got {fn!r}")
        timeout = check_timeout(timeout, "timeout")
        name = getattr(fn, "__qualname__", repr(fn))
        for item in (fn, *args, *kwargs.values()):
            _send_by_value(item if callable(item) else type(item))
        payload = self._dumps((fn, args, kwargs, _source_of(fn)),
                              f"function {name!r} or its arguments")
        return self._dispatch(rank_side.call_pickled, payload, timeout=timeout, ranks=ranks)

    def execute(self, code: str, timeout: float | None = None, ranks=None) -> list:
        """Run code on every rank (what %%ranks does); item r is the last expression's value."""
        if not isinstance(code, str):
            raise TypeError(f"lab.execute needs code as a string, got {type(code).__name__}")
        timeout = check_timeout(timeout, "timeout")
        return self._dispatch(rank_side.execute, code, timeout=timeout, ranks=ranks)

    def push(self, mapping: dict, ranks=None) -> None:
        """Set names in every rank's namespace."""
        if not isinstance(mapping, dict):
            raise TypeError(f"lab.push needs a dict of name -> value, got {type(mapping).__name__}")
        payload = self._dumps(mapping, "a value pushed")
        self._dispatch(rank_side.push_pickled, payload, timeout=None, ranks=ranks)

    def pull(self, name: str, ranks=None) -> list:
        """The value of `name` on every rank; a LabError names the ranks that lack it."""
        results = self._dispatch(rank_side.pull, name, timeout=None, ranks=ranks)
        missing = [r for r, v in zip(self._ranks(ranks), results, strict=True)
                   if isinstance(v, rank_side.Missing)]
        if missing:
            from tplab.lab.output import format_rank_list

            raise LabError(f"name {name!r} is not defined on {format_rank_list(missing)}")
        return results

    def _dispatch(self, remote_fn, payload, timeout, ranks) -> list:
        self._check_open()
        ranks = self._ranks(ranks)
        cell = next(self._cells)
        if len(ranks) < self.world_size:
            view = self._client.direct_view([self._engine_ids[r] for r in ranks])
        else:
            if self._view is None:  # made once per set of rank processes
                self._view = self._client.direct_view(self._engine_ids)
            view = self._view
        ar = view.apply_async(remote_fn, payload, cell)  # one request for all ranks
        return self.watchdog.wait(RankResults(ar, ranks), cell, timeout or self.timeout)


def _source_of(fn) -> tuple[str, list[str]] | None:
    """fn's file name and the lines of its file up to its end (earlier lines blank), so
    that a rank's traceback shows the code (cloudpickle drops file names of code it sends
    by value). Only fn's own lines travel, not the whole file."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    last = max((line for *_, line in code.co_lines() if line), default=code.co_firstlineno)
    lines = linecache.getlines(code.co_filename)[:last]
    first = code.co_firstlineno - 1
    return code.co_filename, ["\n"] * first + lines[first:]


def _send_by_value(obj) -> None:
    """Functions and classes from the notebook (__main__) travel by value anyway; do the
    same for modules that are not installed (a test file, a helper .py next to a notebook),
    which the ranks may not be able to import."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return
    path = getattr(module, "__file__", None) or ""
    installed = any(part in path for part in ("site-packages", "dist-packages", _STDLIB))
    if path and not installed and not module.__name__.startswith("tplab"):
        cloudpickle.register_pickle_by_value(module)


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

