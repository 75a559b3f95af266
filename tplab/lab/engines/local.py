"""Local ranks: engines on this machine, forked from a fork server (tplab/lab/processes.py)
that imported torch once, or started anew (`fork=False`). Their pids are this machine's:
the lab interrupts them by pid, reads their output files here, and watches their exit
codes; they watch the notebook kernel's pid (tplab/rank/entry.py)."""

from __future__ import annotations

import os

import psutil

from tplab.errors import LabError
from tplab.lab import processes
from tplab.lab.arguments import MAX_LOCAL_RANKS, RANK_MEMORY_GIB, gpu_count, resolve_backend
from tplab.lab.engines.kind import EngineKind
from tplab.lab.joining import Rendezvous
from tplab.lab.transports import LocalTransport


class LocalKind(EngineKind):
    name = "local"

    def __init__(self, launcher=None, fork: bool = True):
        super().__init__(launcher)
        self.fork = fork
        self.launcher = processes.ForkedEngineSetLauncher if fork else processes.RankSetLauncher
        self.fork_server: processes.ForkServer | None = None

    def check_size(self, world_size: int, backend: str) -> None:
        """This machine's memory (a rank's share, `RANK_MEMORY_GIB`) and, for NCCL, one GPU
        per rank."""
        per_rank = RANK_MEMORY_GIB["forked" if self.fork else "started"]
        available = psutil.virtual_memory().available / 2**30
        most = int(min(MAX_LOCAL_RANKS, available // per_rank))
        if world_size > most:
            raise LabError(
                f"world_size={world_size} is more than this machine can run: each rank needs "
                f"about {per_rank} GiB and {available:.1f} GiB is available, so at most "
                f"{most} local ranks (tplab caps local ranks at {MAX_LOCAL_RANKS})")
        if backend == "nccl":
            gpus = gpu_count()
            if gpus < world_size:
                raise LabError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                               f"but this machine has {gpus} GPU(s); use backend='gloo' (CPU) "
                               f"or 'auto'")

    def configure(self, config, env: dict, state_dir: str) -> None:
        config.LocalEngineSetLauncher.delay = 0.0  # no stagger between engines

    def prepare(self, env: dict, state_dir: str) -> list[int]:
        """The fork server first: its torch import overlaps the controller's start."""
        if not self.fork:
            return []
        log_dir = os.path.join(state_dir, "profile", "log")
        os.makedirs(log_dir, exist_ok=True)
        self.fork_server = processes.ForkServer(env, os.path.join(log_dir, "zygote.log"))
        return [self.fork_server.pid]

    def ready(self, timeout: float) -> None:
        if self.fork_server is not None:
            self.fork_server.wait_ready(timeout=timeout)

    def start_options(self, first_id: int, env: dict) -> dict:
        options = {"first_id": first_id}  # engine id = first_id + rank (processes.py)
        if self.fork_server is not None:
            options["fork_server"] = self.fork_server
        return options

    def engine_ids(self, first_id: int, n: int) -> list[int]:
        return [first_id + r for r in range(n)]

    def resolve_backend(self, backend: str, world_size: int) -> str:
        return resolve_backend(backend, world_size)  # this machine's GPUs decide "auto"

    def local_rank(self, rank: int) -> int:
        return rank

    def rendezvous(self, planned: Rendezvous, ask) -> Rendezvous:
        """The store at the lab's address, as planned."""
        return planned

    def transport(self) -> LocalTransport:
        """Pids of this machine: signals by pid, output files read here."""
        return LocalTransport()

    def start_error(self, exc: BaseException, state_dir: str) -> BaseException:
        return exc  # a local start that fails raises as it is

    def local_pids(self, engine_set) -> list[int]:
        return [el.pid for el in getattr(engine_set, "launchers", {}).values()
                if getattr(el, "pid", 0) > 0]

    def check(self, engine_set, remote: bool, state_dir: str) -> str | None:
        return None  # local ranks: their exit codes say it (LabProcesses.dead)


KIND = LocalKind
