"""Local ranks: engines on this machine, forked from a fork server (tplab/lab/processes.py)
that imported torch once, or started anew (`fork=False`). Their pids are this machine's:
the lab interrupts them by pid, reads their output files here, and watches their exit
codes; they watch the notebook kernel's pid (tplab/rank/entry.py)."""

from __future__ import annotations

import os

from tplab.lab import processes
from tplab.lab.engines.kind import EngineKind
from tplab.lab.validate import resolve_backend


class LocalKind(EngineKind):
    name = "local"
    ranks_are_local = True

    def __init__(self, launcher=None, fork: bool = True):
        super().__init__(launcher)
        self.fork = fork
        self.launcher = processes.ForkedEngineSetLauncher if fork else processes.RankSetLauncher
        self.fork_server: processes.ForkServer | None = None

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

    def rendezvous(self, processes, ip: str, master_addr: str, port: int, given: bool,
                   generation: int, wait) -> tuple[str, int, None]:
        """The store at the lab's address; output files read here, nothing forwarded."""
        return master_addr, port, None

    def start_error(self, exc: BaseException, state_dir: str) -> BaseException:
        return exc  # a local start that fails raises as it is

    def local_pids(self, engine_set) -> list[int]:
        return [el.pid for el in getattr(engine_set, "launchers", {}).values()
                if getattr(el, "pid", 0) > 0]

    def check(self, engine_set, remote: bool, state_dir: str) -> str | None:
        return None  # local ranks: their exit codes say it (LabProcesses.dead)


KIND = LocalKind
