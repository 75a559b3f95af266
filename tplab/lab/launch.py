"""`tplab.launch`: start N rank processes from a notebook and run code on them SPMD.

Built on ipyparallel (a controller plus one engine per rank), so its other engine
launchers (mpi, slurm, ssh...) are a parameter away: `tplab.launch(8, engines="mpi")`.
One `Lab` object owns the processes' whole life: start, restart, shutdown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import tempfile
import time
import types
import weakref

import ipyparallel as ipp

from tplab import platforms
from tplab.core.output import strip_ansi
from tplab.errors import CellTimeout, LabError
from tplab.lab import joining
from tplab.lab.addresses import address
from tplab.lab.arguments import (
    check_launch_args,
    check_threads,
    check_timeout,
    split_cluster_options,
)
from tplab.lab.cell_watch import deferred_interrupts
from tplab.lab.cells import Cells
from tplab.lab.cluster import LabProcesses, choose_kind
from tplab.lab.joining import Rendezvous
from tplab.lab.magics import register_magics
from tplab.lab.names import RankNames
from tplab.lab.time_limit import stop_after
from tplab.lab.watchdog import Watchdog
from tplab.rank import network
from tplab.rank import runner as rank_side

_log = logging.getLogger("tplab.ipyparallel")
_log.setLevel(logging.ERROR)  # keep ipyparallel's log noise out of notebook outputs
_log.propagate = False
_log.addHandler(logging.StreamHandler(sys.stderr))

DEFAULT_TIMEOUT_S = 60.0  # a cell that runs longer than this in a workshop is a hang


@dataclasses.dataclass
class CellLimit:
    """What `Lab.time_limit` yields (tplab/lab/contract.py, TimeLimit)."""

    seconds: float
    reached: bool = False


class Lab:
    """N rank processes, each an ipyparallel engine with torch.distributed initialised.

    Use `tplab.launch(...)` to make one. `run`, `execute`, `push` and `pull` return one
    item per rank, in rank order. See docs/DESIGN.md for the whole contract.
    """

    world_size: int
    in_process = False  # rank processes (tplab/lab/contract.py, Ranks)
    backend: str  # "gloo" or "nccl" ("auto": the ranks decide, when the kind cannot)
    threads_per_rank: int  # torch threads of each rank (OMP_NUM_THREADS)

    def __init__(self, world_size: int = 4, backend: str = "auto", engines="local",
                 timeout: float | None = None, cell_timeout: float | None = None,
                 ip: str = "127.0.0.1", threads_per_rank: int | None = None,
                 fork: bool | None = None, master_addr: str | None = None,
                 cluster_options: dict | None = None,
                 **more_cluster_options):
        # The fork server is the default on Linux only: on macOS forking after torch is
        # imported crashes the child (tplab/platforms.py says why).
        fork = platforms.default_fork() if fork is None else fork
        check_launch_args(world_size, backend, ip, fork)
        if cluster_options is not None and not isinstance(cluster_options, dict):
            raise TypeError(f"cluster_options must be a dict of ipyparallel.Cluster options, "
                            f"got {type(cluster_options).__name__}")
        self._cluster_options = split_cluster_options(
            {**(cluster_options or {}), **more_cluster_options}, launch_keywords())
        self.world_size = world_size
        # how ranks start, stop, are heard (LabProcesses is the kind's only caller)
        self.kind, self.backend = choose_kind(engines, fork, world_size, backend)
        self.engines = engines
        self.timeout = check_timeout(timeout, "timeout") or DEFAULT_TIMEOUT_S
        self.cell_timeout = check_timeout(cell_timeout, "cell_timeout")
        self.ip = ip
        self.address = address(ip)  # what ip= means: where to listen, what others reach
        self.threads_per_rank = check_threads(threads_per_rank) or max(
            1, (os.cpu_count() or 1) // world_size)
        # Where rank 0's rendezvous store listens: the lab's ip, or this host's name when
        # the lab listens on every interface (so that ranks elsewhere can reach it).
        self._master_addr = master_addr or self.address.contact
        self._master_addr_given = master_addr is not None  # else: rank 0's, for remote ranks
        self.rendezvous: Rendezvous | None = None  # where the running ranks met
        self.fork = fork  # local ranks forked from a process that imported torch once
        self._closed = False
        self._broken = ""  # why the ranks need a restart before the next cell (or "")
        self.names = RankNames(world_size)  # which names each rank defines itself
        self._state_dir = tempfile.mkdtemp(prefix="tplab-")  # mode 0700: owner only
        self.processes = LabProcesses(self.kind, self._state_dir)
        self._finalizer = weakref.finalize(self, LabProcesses.close, self.processes)
        self.watchdog = Watchdog(world_size, self.processes, self._restart_ranks,
                                 self.names.lost)
        self.cells = Cells(world_size, self.processes, self.names, self.watchdog, self._ready)
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
        """The pid of each rank process (on its own host), in rank order."""
        return list(self.processes.pids)

    @property
    def shared_dir(self) -> str | None:
        """A folder the ranks read as this process does: the lab's own, when the ranks run
        on this machine; None for ranks elsewhere."""
        return self.processes.shared_dir()

    @property
    def master_addr(self) -> str:
        """Where rank 0's store listens (this start of the ranks)."""
        return self.rendezvous.master_addr if self.rendezvous else self._master_addr

    @property
    def master_port(self) -> int | None:
        return self.rendezvous.master_port if self.rendezvous else None

    @contextlib.contextmanager
    def time_limit(self, seconds: float):
        """Every cell in the block gets `cell_timeout=seconds` (the watchdog interrupts the
        ranks, a CellTimeout, and the lab stays usable), whatever the lab's own is; the
        learner's code that runs in this process meanwhile (a one-device reference) is
        stopped between bytecodes (tplab/lab/time_limit.py). Yields the limit (`.reached`:
        a cell, or code here, ran past it)."""
        seconds = check_timeout(seconds, "time_limit")
        if seconds is None:
            raise ValueError("time_limit needs a positive number of seconds, got None")
        limit, before = CellLimit(seconds), self.cell_timeout
        self.cell_timeout = seconds
        try:
            with stop_after(seconds) as here:
                try:
                    yield limit
                finally:
                    limit.reached = limit.reached or here.reached
        except CellTimeout:
            limit.reached = True
            raise
        finally:
            self.cell_timeout = before

    # --- life ------------------------------------------------------------------------

    def _start(self) -> None:
        started = time.monotonic()
        env = self.processes.rank_environment(self.threads_per_rank, self.address.loopback)
        options, self._engine_env = self.processes.cluster_options(
            self.world_size, self.ip, env, self._cluster_options, _log)
        self.processes.start_controller(options, env, max(60.0, self.timeout))
        self._start_ranks()
        self.startup_s = time.monotonic() - started

    def _start_ranks(self) -> None:
        wait = joining.StartWait(self._start_limit_s(), self._starting_pids)
        self.processes.start_engines(self.world_size, self._engine_env, wait)
        self._init_ranks()

    def _init_ranks(self) -> None:
        planned = Rendezvous(self._master_addr, network.free_port(self.address.bind),
                             self._master_addr_given, self.address.contact)
        # where rank 0's store listens, and where the ranks' output goes: the kind's
        agreed = self.processes.rendezvous(planned, self.address.bind,
                                           functools.partial(self._wait_for_init, planned))
        ars = [
            self.processes.client[eid].apply_async(
                rank_side.init_rank, r, self.world_size, self.backend, agreed.master_addr,
                agreed.master_port, self.threads_per_rank, self.processes.local_rank(r),
                120.0, agreed.output_to)
            for r, eid in enumerate(self.processes.engine_ids)
        ]
        self.processes.joined(self._wait_for_init(agreed, ars))
        self.rendezvous = agreed
        self.names.reset()
        self.cells.forget_ranks()  # fresh ranks: no view on them, sys.path not sent
        self.watchdog.connect_store(agreed.master_addr, agreed.master_port)

    def _start_limit_s(self) -> float:
        """How long ranks may take to register and join: 8 s per rank per core, counting
        the machine's other busy processes (a room of labs starting at once), at least
        60 s or the lab's timeout; stretched while the ranks still use CPU (joining.py)."""
        return joining.start_limit_s(self.world_size, self.timeout)

    def _starting_pids(self) -> list[int]:
        """The rank processes being started, in rank order (local engines only)."""
        return self.processes.starting_pids()

    def _wait_for_init(self, rendezvous: Rendezvous, ars: list) -> list[dict]:
        """Each rank's reply to `ars`, waiting as a start does; a rank that does not answer
        is reported with where it was to meet (`rendezvous`)."""
        wait = joining.StartWait(self._start_limit_s(), self._starting_pids)
        infos = []
        for r, ar in enumerate(ars):
            while not ar.ready():
                self.processes.fail_if_a_rank_exited()
                if wait.expired():
                    raise LabError(joining.join_report(
                        r, self._starting_pids(), self._state_dir, self.backend,
                        rendezvous.master_addr, rendezvous.master_port, wait.elapsed,
                        self.world_size))
                ar.wait(0.05)
            try:
                infos.append(ar.get(0))
            except ipp.error.RemoteError as exc:
                detail = strip_ansi("\n".join(exc.render_traceback()))
                raise LabError(f"rank {r} could not join the process group "
                               f"({self.backend}):\n{detail}") from None
        return infos

    @property
    def pids(self) -> list[int]:
        """Every process this lab started and that is still running: the controller and
        its schedulers, the fork server, every rank (and its nanny, where ipyparallel
        starts one). Ranks that another launcher started are here only as descendants of
        a local launcher process (mpiexec): a pid on another host means nothing here."""
        return self.processes.all_pids()

    def restart(self) -> float:
        """Start fresh rank processes (same settings, same controller); returns seconds.
        Names defined on the ranks are gone afterwards."""
        self._check_open()
        return self._restart_ranks()

    def _restart_ranks(self) -> float:
        """End every rank process, then start fresh ones (restart(), the Watchdog's
        recoveries, and a cell after a restart that did not finish all come here). An
        interrupt in the middle is held back until the ranks are consistent again; if the
        start itself fails, the lab is marked broken and the next cell starts over."""
        started = time.monotonic()
        with deferred_interrupts() as held:
            self._broken = "the last restart did not finish"
            self.watchdog.disconnect_store()
            self.processes.stop_ranks()
            self.cells.forget_ranks()
            self.names.clear()
            self._start_ranks()
            self._broken = ""
        if held.pressed:
            raise KeyboardInterrupt
        return time.monotonic() - started

    def shutdown(self) -> None:
        """End every process the lab started and remove its state directory."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.disconnect_store()
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise LabError("this lab was shut down; start a new one with tplab.launch(...)")

    def _ready(self) -> int:
        """Before a request: the lab open and its ranks started (a restart that did not
        finish is redone first); returns the generation of the running ranks."""
        self._check_open()
        if self._broken:
            print(f"[tplab] {self._broken}: restarting the ranks first (names defined on them "
                  "are gone)", file=sys.stderr, flush=True)
            self._restart_ranks()
        return self.processes.generation

    # --- cells (cells.py does the work; these are the contract, tplab/lab/contract.py) ---

    def run(self, fn, *args, timeout: float | None = None, ranks=None,
            cell_timeout: float | None = None, **kwargs) -> list:
        """Call fn(*args, **kwargs) on every rank (or on `ranks`, in that order); item i is
        the result of the i-th rank asked. A function defined in the notebook runs with the
        rank's namespace as its globals: the rank's own names (rank, world_size, pushed
        values...) win over the notebook's, and `global` assignments stay on the rank."""
        return self.cells.run(fn, args, kwargs, *self._limits(timeout, cell_timeout, ranks))

    def execute(self, code: str, timeout: float | None = None, ranks=None,
                cell_timeout: float | None = None) -> list:
        """Run code on every rank (what %%ranks does); item r is the last expression's value."""
        return self.cells.execute(code, *self._limits(timeout, cell_timeout, ranks))

    def push(self, mapping: dict, ranks=None) -> None:
        """Set names in every rank's namespace (they are the ranks' own names from then on)."""
        self.cells.push(mapping, ranks, self.timeout, self.cell_timeout)

    def pull(self, name: str, ranks=None) -> list:
        """The value of `name` on every rank; a LabError names the ranks that lack it."""
        return self.cells.pull(name, ranks, self.timeout, self.cell_timeout)

    def reload(self, module: types.ModuleType) -> types.ModuleType:
        """Reload an edited module here and on every rank that imported it (importlib.reload
        on each); functions from it that later cells send run the new code. Returns the
        reloaded module, as importlib.reload does."""
        return self.cells.reload(module)

    def _limits(self, timeout, cell_timeout, ranks) -> tuple:
        """(timeout, ranks, cell_timeout) of one call: the call's, else the lab's."""
        timeout = check_timeout(timeout, "timeout")
        cell_timeout = check_timeout(cell_timeout, "cell_timeout")
        return timeout or self.timeout, ranks, cell_timeout or self.cell_timeout

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"{len(self.processes.pids)} ranks running"
        return (f"<tplab.Lab world_size={self.world_size} backend={self.backend!r} "
                f"engines={self.engines!r}: {state}>")

def launch_keywords() -> list[str]:
    """tplab's own keywords of `tplab.launch` / `Lab` (read from Lab.__init__)."""
    return [name for name, p in inspect.signature(Lab.__init__).parameters.items()
            if name != "self" and p.kind is not p.VAR_KEYWORD]


def launch(world_size: int = 4, backend: str = "auto", engines="local",
           timeout: float | None = None, **cluster_options) -> Lab:
    """Start `world_size` ranks and return the `Lab` that owns them.

    backend: "auto" (NCCL with one GPU per rank when there are enough GPUs, else gloo),
    "gloo" or "nccl". engines: an engine kind's file name in tplab/lab/engines/ ("local",
    "mpi", "ssh", "slurm", "batch"), an EngineKind object, or another ipyparallel engine
    launcher ("pbs", ...; pass an ip= that remote engines can reach). timeout: seconds
    the unfinished ranks may all wait in collectives, none computing, before tplab reports
    a hang (default 60); a rank that computes is never timed out (cell_timeout=, off by
    default, is a wall-clock limit).
    Other keywords: those of `Lab` (cell_timeout, ip, threads_per_rank, fork,
    master_addr, cluster_options) and of ipyparallel.Cluster.
    """
    lab = Lab(world_size, backend=backend, engines=engines, timeout=timeout, **cluster_options)
    register_magics(lab)
    return lab

