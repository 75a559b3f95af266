"""An engine kind: how one kind of rank process is started, found, heard, watched and
stopped. `EngineKind` itself is the generic kind, for any ipyparallel engine launcher
(a name such as "pbs", or a launcher class); local.py, mpi.py, ssh.py and slurm.py refine
it. `kind_for("name")` finds the kind in `tplab/lab/engines/name.py` (a module that
defines `KIND`), else the generic one: adding a kind is adding one file (docs/DESIGN.md,
"Engine kinds").

What a lab asks of its kind (tplab/lab/cluster.py calls these, and nothing else does):
- `check_size(world_size, backend)`, `resolve_backend(backend, world_size)`: before
  anything starts;
- `configure(config, env, state_dir)`: the launcher's settings and the ranks' environment;
  `launcher`: the ipyparallel engine launcher (a name or a class);
- `prepare(env, state_dir)` before the controller starts (the fork server), `ready()`;
- `start_options(first_id, env)`: extra arguments of `Cluster.start_engines`;
- `engine_ids(first_id, n)`: which engine ids the new ranks register as (None: any new);
- `rendezvous(planned, ask)`: where rank 0's store listens (a joining.Rendezvous);
- `local_rank(rank)`: a rank's GPU index on its host (or the launcher's variables for it);
- `local_pids(engine_set)`: local processes the lab may kill (never a pid elsewhere);
- `transport()`: how the running ranks are reached (tplab/lab/transports.py): a
  LocalTransport (pids of this machine: signals by pid, output files read here) or a
  RemoteTransport (output forwarded, tplab/rank/output_relay.py; interrupts through ipyparallel);
- `check(engine_set, remote, state_dir)`: a start failure, said with the fix;
- `stop(engine_sets)`: end what runs elsewhere (ssh engines, batch jobs).
"""

from __future__ import annotations

import dataclasses
import os

from ipyparallel.cluster.launcher import BatchSystemLauncher, LocalProcessLauncher, SSHLauncher

from tplab.errors import LabError
from tplab.lab.engines import watch
from tplab.lab.joining import Rendezvous
from tplab.lab.transports import RemoteTransport
from tplab.rank import network
from tplab.rank.entry import HEARTBEAT_ENV


class EngineKind:
    """The generic kind: engines that ipyparallel's launcher `launcher` starts, perhaps on
    other hosts; they watch the controller's heartbeat (a pid means nothing elsewhere),
    forward their output to the notebook, and get engine ids the hub picks."""

    name = "generic"
    launcher_base: type | None = None  # kind_for(a launcher class) picks the kind by this

    def __init__(self, launcher=None, fork: bool = False):
        self.launcher = launcher if launcher is not None else self.name

    # --- starting ------------------------------------------------------------------------

    def configure(self, config, env: dict, state_dir: str) -> None:
        """The lab's defaults for this launcher (the user's cluster_options config wins):
        engines watch the controller's heartbeat (tplab/rank/entry.py), and get the notebook's
        PYTHONPATH (the engines run the notebook's Python at the same path, so its
        PYTHONPATH names the same folders there; ssh and mpiexec do not pass it on)."""
        env[HEARTBEAT_ENV] = "connection-file"
        if os.environ.get("PYTHONPATH"):
            env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])

    def check_size(self, world_size: int, backend: str) -> None:
        """Raise LabError when this kind cannot run `world_size` ranks on `backend` (before
        anything starts); the generic kind cannot know the other hosts: the launch says."""

    def prepare(self, env: dict, state_dir: str) -> list[int]:
        """Start what must run before the controller; returns the pids it started."""
        return []

    def ready(self, timeout: float) -> None:
        """Wait for what prepare() started."""

    def start_options(self, first_id: int, env: dict) -> dict:
        return {}

    def engine_ids(self, first_id: int, n: int) -> list[int] | None:
        return None

    def resolve_backend(self, backend: str, world_size: int) -> str:
        """"auto" is decided on the ranks (they know their GPUs) unless the kind knows."""
        return backend

    # where a launcher says which process of a host a rank is (its GPU index there)
    local_rank_vars: tuple[str, ...] = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                        "MPI_LOCALRANKID", "SLURM_LOCALID")

    def local_rank(self, rank: int) -> int | tuple[str, ...]:
        """The GPU index of `rank` on its host when the kind decides it, else the names of
        the launcher's variables the rank reads it from (rank.init_rank)."""
        return self.local_rank_vars

    def rendezvous(self, planned: Rendezvous, ask) -> Rendezvous:
        """Before the ranks join: where rank 0's store listens. Ranks elsewhere: on rank
        0's host (its address on the route to the controller, unless master_addr was
        given), and gloo on the interface that reaches it (tplab/rank/network.py).
        `ask(fn, *args, ranks=None)` calls fn on the ranks and waits as the start does."""
        agreed = planned
        if not planned.addr_given:
            where = ask(network.rank_address, planned.contact, ranks=[0])[0]
            agreed = dataclasses.replace(planned, master_addr=where["address"],
                                         master_port=where["port"])
        ask(network.point_gloo_at, agreed.master_addr)
        return agreed

    def transport(self) -> RemoteTransport:
        """Ranks elsewhere: output forwarded, interrupts through ipyparallel, no pid here."""
        return RemoteTransport()

    def start_error(self, exc: BaseException, state_dir: str) -> LabError:
        return watch.start_error(self.launcher, exc, state_dir)

    # --- processes ---------------------------------------------------------------------

    def local_pids(self, engine_set) -> list[int]:
        """Local launcher processes (mpiexec-like); never a batch job or a remote pid (an
        ssh launcher's pid is the engine's on its host)."""
        def local(el) -> bool:
            return (isinstance(el, LocalProcessLauncher) and not isinstance(el, SSHLauncher)
                    and getattr(el, "pid", 0) > 0)

        if isinstance(engine_set, BatchSystemLauncher):
            return []
        return [el.pid for el in [engine_set, *getattr(engine_set, "launchers", {}).values()]
                if local(el)]

    def stop(self, engine_sets, timeout: float = 10.0) -> None:
        """End what runs elsewhere (local processes are ended by pid, processes.kill_trees)."""

    # --- watching a start --------------------------------------------------------------

    def check(self, engine_set, remote: bool, state_dir: str) -> str | None:
        """A message when the engines failed to start, else None (watch.EngineWatch)."""
        if not isinstance(engine_set, LocalProcessLauncher) or engine_set.process is None:
            return None
        lines = watch.tail(engine_set.output_file)
        ended, code = watch.ended(engine_set.process)
        fatal = watch.fatal_part(lines)
        name = type(engine_set).__name__
        if ended:
            status = f"with status {code}" if code is not None else ""
            command = os.path.basename(engine_set.args[0]) if engine_set.args else name
            return watch.message(
                f"{command} (pid {engine_set.pid}) exited {status} before every engine "
                "registered", fatal or lines[-12:], engine_set.output_file, state_dir)
        if fatal:
            return watch.message(f"an engine started by {name} failed", fatal,
                                 engine_set.output_file, state_dir)
        return None

    def __repr__(self) -> str:
        return f"<engine kind {self.name!r}: {self.launcher!r}>"
