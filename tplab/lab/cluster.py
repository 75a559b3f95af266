"""The one owner of a lab's processes: `LabProcesses`.

It holds everything the lab started and knows of it: the ipyparallel cluster (controller
and engine sets), the engine kind (tplab/lab/engines/) that says how ranks start and stop,
the local pids the lab may kill, the ranks' pids and engine ids in rank order, and the
kind's transport (tplab/lab/transports.py: where the output comes from, how ranks are
interrupted, how a death is noticed, which pids are this machine's). It is the kind's only
caller. The Watchdog sees the ranks through it (`dead`, `interrupt`, `read_output`,
`log_tail`, `catch_up`, `settle`); `close` is the lab's finalizer (it needs no Lab).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import signal
import time

import ipyparallel as ipp
from traitlets.config import Config

from tplab import platforms
from tplab.errors import LabError
from tplab.lab import processes
from tplab.lab.engines import EngineKind, EngineWatch, kind_for
from tplab.lab.joining import Rendezvous
from tplab.rank import heartbeat
from tplab.rank.entry import OWNER_ENV, STATE_DIR_ENV, owner_token

HUB_CHECK_S = 2.0  # how often a start still waiting asks the hub which engines registered
ENGINE_IDS_PER_START = 1024  # start g of the ranks asks the hub for ids g*1024 + rank


def choose_kind(engines, fork: bool, world_size: int, backend: str) -> tuple[EngineKind, str]:
    """The kind for `engines=` (engines.kind_for), once it said it can run `world_size`
    ranks on `backend`, and the backend it resolves "auto" to (before anything starts)."""
    kind = kind_for(engines, fork=fork)
    kind.check_size(world_size, backend)
    return kind, kind.resolve_backend(backend, world_size)


class LabProcesses:
    """Every process of one lab (see the module docstring)."""

    def __init__(self, kind, state_dir: str):
        self.kind, self.state_dir = kind, state_dir
        self.cluster = self.client = None
        self.roots: list[int] = []  # local processes to end: controller, launchers, fork server
        self.extra_roots: list[int] = []
        self.engine_sets: list = []  # ipyparallel engine set launchers of the current ranks
        self.engine_ids: list[int] = []  # ipyparallel engine id of each rank, in rank order
        self.pids: list[int] = []  # each rank's pid (on its own host), in rank order
        self.hosts: list[str] = []  # each rank's host name
        self.transport = kind.transport()  # how the running ranks are reached
        self.files = self.transport.output  # their output, as it arrives
        self.watch: EngineWatch | None = None  # while ranks start: the kind's checks
        self._starts = itertools.count(1)
        self.generation = 0  # which start of the ranks runs (a restart makes a new one)
        self._requests = itertools.count(1)  # the number of the next request to the ranks

    def local_rank(self, rank: int):
        """`rank`'s GPU index on its host, or the launcher's variables that say it."""
        return self.kind.local_rank(rank)

    def shared_dir(self) -> str | None:
        """The lab's folder when the ranks read it as this process does, else None."""
        return self.transport.shared_dir(self.state_dir)

    # --- starting ------------------------------------------------------------------------

    def rank_environment(self, threads: int, loopback: bool) -> dict:
        """The environment every rank process starts with (gloo on loopback if `loopback`)."""
        env = {
            OWNER_ENV: owner_token(),
            STATE_DIR_ENV: self.state_dir,
            "IPYTHONDIR": os.path.join(self.state_dir, "ipython"),
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
        if loopback:  # gloo on loopback, not the hostname's address
            env.update(platforms.rank_env())
        return env

    def cluster_options(self, n: int, ip: str, env: dict, user: dict, log) -> tuple[dict, dict]:
        """ipyparallel.Cluster's options for the lab (the user's `user` options win, the
        lab's config stays under theirs), and the environment the engines get."""
        config = Config()
        config.BaseLauncher.environment = env
        python = platforms.engine_python()  # the kernel's own Python (JupyterHub, venvs)
        config.EngineLauncher.engine_cmd = [python, "-m", "tplab.rank.entry", "engine"]
        config.ControllerLauncher.controller_cmd = [
            python, "-m", "tplab.rank.entry", "controller"]
        self.kind.configure(config, env, self.state_dir)
        options = dict(
            n=n, engines=self.kind.launcher, controller_ip=ip,
            controller_args=[f"--HeartMonitor.period={heartbeat.SLOW_MS}", "--log-level=ERROR"],
            profile_dir=os.path.join(self.state_dir, "profile"), cluster_id="tplab",
            cluster_file="",  # not needed: the Lab object is the only handle on the cluster
            delay=0.0, send_engines_connection_env=False, shutdown_atexit=False,
            load_profile=False, log=log, config=config,
        )
        options.update(user)
        if "config" in user:  # the user's settings win, the lab's stay
            config.merge(Config(user["config"]))
            options["config"] = config
        return options, {**env, **dict(config.BaseLauncher.environment)}

    def start_controller(self, options: dict, env: dict, timeout: float) -> None:
        self.extra_roots = self.kind.prepare(env, self.state_dir)
        self.cluster = ipp.Cluster(**options)
        self.cluster.start_controller_sync()
        self._remember_roots()
        self.kind.ready(timeout)

    def start_engines(self, n: int, env: dict, wait) -> list[int]:
        """Start n engines, a new generation of ranks; returns their engine ids, in rank
        order, once all registered (`wait`, a joining.StartWait, says when to give up)."""
        self.generation = next(self._starts)
        first_id = self.generation * ENGINE_IDS_PER_START
        # The client connects BEFORE the engines start: it learns of engines that register
        # after it connected from the hub's notifications, which a subscriber only gets once
        # its subscription is through (zmq's slow joiner). Connected while 32 engines
        # registered, it missed 2 of them for good in about one start in two.
        fresh = self.client is None  # a restart keeps its client (subscribed long ago)
        if fresh:
            self.client = self.cluster.connect_client_sync()
        before = set(self.client.ids)
        try:
            set_id = self.cluster.start_engines_sync(n, **self.kind.start_options(first_id, env))
        except Exception as exc:
            raise self.kind.start_error(exc, self.state_dir) from None
        self.engine_sets = [self.cluster.engines[set_id]]
        self._remember_roots()
        self.watch = EngineWatch(self.kind, self.engine_sets, self.state_dir)
        wanted = self.kind.engine_ids(first_id, n)
        asked = time.monotonic()
        while True:
            if fresh and time.monotonic() - asked > HUB_CHECK_S:
                asked = time.monotonic()
                self.catch_up_with_the_hub()
            ids = set(self.client.ids)
            if wanted is not None and ids.issuperset(wanted):
                self.engine_ids = wanted
                break
            new = sorted(ids - before)
            if wanted is None and len(new) >= n:
                self.engine_ids = new[:n]
                break
            if wait.expired():
                raise LabError(
                    f"only {len(ids - before)} of {n} ranks started within {wait.elapsed:.0f} s; "
                    f"the engines' logs are in {self.state_dir}/profile/log")
            self.fail_if_a_rank_exited()
            time.sleep(0.01)
        return self.engine_ids

    def catch_up_with_the_hub(self) -> None:
        """Engines the hub registered but the client never heard of (a notification lost):
        a new client learns every registered engine from the hub when it connects."""
        try:
            known = {k for k in self.client.queue_status() if isinstance(k, int)}
        except Exception:  # the hub is busy or gone: the wait's own checks say what happened
            return
        if not known.issubset(self.client.ids):
            old, self.client = self.client, self.cluster.connect_client_sync()
            old.close()

    def rendezvous(self, planned: Rendezvous, listen: str, wait) -> Rendezvous:
        """Where this start of the ranks meets (the kind agrees the lab's plan) and where
        their output goes (the transport's); `wait(async results)` waits as the start does."""
        def ask(fn, *args, ranks=None):
            ranks = range(len(self.engine_ids)) if ranks is None else ranks
            return wait([self.client[self.engine_ids[r]].apply_async(fn, *args) for r in ranks])

        agreed = self.kind.rendezvous(planned, ask)
        return dataclasses.replace(agreed, output_to=self.transport.output_to(
            listen, agreed.contact, self.generation))

    def joined(self, infos: list[dict]) -> None:
        """The ranks joined the process group: their pids, hosts and output."""
        self.pids = [info["pid"] for info in infos]
        self.hosts = [info["host"] for info in infos]
        self.transport.joined(infos)
        self.watch = None  # started: what engines log from now on is the user's

    def next_request(self) -> int:
        """A new request's number (the ranks tell a cell's reports by it)."""
        return next(self._requests)

    def send(self, ranks: list[int], remote_fn, *args):
        """A request to some ranks, outside a cell's watch; its AsyncResult."""
        view = self.client.direct_view([self.engine_ids[r] for r in ranks])
        return view.apply_async(remote_fn, *args, self.next_request())

    def starting_pids(self) -> list[int]:
        """The rank processes being started that this machine runs, in rank order."""
        return self.transport.killable(self.exit_codes())

    def fail_if_a_rank_exited(self) -> None:
        failed = self.watch.check() if self.watch is not None else None
        if failed:
            raise LabError(f"the engines ({self.kind.launcher!r}) failed to start: {failed}")
        dead = self.dead()
        if dead:
            pid = next(p for p, c in self.exit_codes().items() if c is not None)
            log = self.state_dir + "/profile/log"
            tail = processes.log_tail(log, pid)
            raise LabError(f"a rank process exited while starting ({next(iter(dead.values()))})"
                           f"; its last lines:\n{tail}\n(logs: {log}, {self.state_dir}/output)")

    def _remember_roots(self) -> None:
        roots = []
        controller = self.cluster.controller if self.cluster else None
        if controller is not None and getattr(controller, "pid", -1) > 0:
            roots.append(controller.pid)
        for engine_set in self.engine_sets:
            roots += self.kind.local_pids(engine_set)  # never a pid on another host
        self.roots = roots

    def controller_pid(self) -> int:
        controller = self.cluster.controller if self.cluster is not None else None
        return getattr(controller, "pid", -1) if controller is not None else -1

    def all_pids(self) -> list[int]:
        """Every local process of the lab still running, with its descendants."""
        return processes.tree(self.roots + self.extra_roots + self.transport.killable(self.pids))

    # --- stopping ------------------------------------------------------------------------

    def stop_ranks(self) -> None:
        """End every rank process (the controller stays)."""
        self.kind.stop(self.engine_sets)  # ssh engines, batch jobs
        old = [pid for pid in self.roots if pid != self.controller_pid()]
        ranks = self.transport.killable(self.pids)  # pids elsewhere mean nothing here
        processes.kill_trees(old + ranks, timeout=0)  # they die on their own
        for set_id in list(self.cluster.engines):
            self.cluster.engines.pop(set_id)
        self.engine_sets, self.pids = [], []
        self.files.detach_all()
        self._remember_roots()

    def close(self) -> None:
        """End everything and remove the state folder (the lab's finalizer). The folder goes
        first: jupyter_client SIGTERMs a kernel 2.5 s into its shutdown, and ending the
        processes can take longer under load; a kernel killed after its ranks are gone
        (their owner watch would remove the folder) must not leave it behind."""
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:  # noqa: BLE001 - closing: nothing more to do about it
                pass
        self.kind.stop(self.engine_sets)
        processes.kill_trees(self.roots + self.extra_roots)
        if self.cluster is not None:
            self.cluster.engines.clear()
            self.cluster.controller = None
        self.files.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)  # what an ending process wrote

    # --- what the watchdog sees ----------------------------------------------------------

    def exit_codes(self) -> dict[int, int | None]:
        """pid -> exit code (None while running) of every local rank process started."""
        codes: dict[int, int | None] = {}
        for engine_set in self.engine_sets:
            if hasattr(engine_set, "exit_codes"):
                codes.update(engine_set.exit_codes())
        return codes

    def dead(self) -> dict[int, str]:
        """rank -> how it ended, for every rank process that is gone (-1: not a rank yet)."""
        out = {}
        for pid, code in self.exit_codes().items():
            if code is not None:
                out[self.pids.index(pid) if pid in self.pids else -1] = \
                    processes.how_it_ended(code)
        out.update(self.transport.ended(self.hosts))
        return out

    def interrupt(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        """A signal to these ranks, as the transport sends it: by pid here; through
        ipyparallel (the engines' nannies) for ranks elsewhere."""
        if ranks:
            self.transport.interrupt(ranks, sig, self.pids, self._signal_engines)

    def _signal_engines(self, sig: int, ranks: list[int]) -> None:
        self.client.send_signal(sig, targets=[self.engine_ids[r] for r in ranks], block=False)

    def read_output(self) -> list[tuple[int, str, str]]:
        return self.files.read()

    def catch_up(self, replies: dict) -> None:
        """Output a finished rank's reply carries that was not forwarded yet."""
        self.files.catch_up(replies)

    def settle(self, ranks, timeout: float = 2.0) -> None:
        """Wait (a little) until the output of ranks that ended has all arrived."""
        self.files.settle(ranks, timeout)

    def log_tail(self, rank: int, lines: int = 15) -> str:
        return self.files.tail(rank, lines)
