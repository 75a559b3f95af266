"""How the notebook reaches a lab's running ranks: a transport, which the engine kind hands
back (`EngineKind.transport()`; LabProcesses, tplab/lab/cluster.py, is its only user). It
says where the ranks' output is read, how they are interrupted, how a death is noticed,
and which of their pids this machine may kill.

- `LocalTransport`: ranks on this machine. Their pids are this machine's: the lab
  interrupts them by pid, may kill them, and reads their output files here
  (streams.RankFiles); a death is an exit code, which the launcher keeps.
- `RemoteTransport`: ranks elsewhere. A pid means nothing here: signals go through
  ipyparallel (the engines' nannies), no pid is killed here, the output is forwarded to
  this machine (relayed_output.py, tplab/rank/output_relay.py), and a rank whose forwarded stream
  closed has ended.
"""

from __future__ import annotations

import os

from tplab.lab.relayed_output import ForwardedOutput
from tplab.lab.streams import RankFiles


class LocalTransport:
    """Ranks on this machine (see the module docstring)."""

    def __init__(self):
        self.output = RankFiles()

    def output_to(self, listen: str, contact: str, generation: int) -> None:
        """Where the ranks send their output: nowhere, their files are read here."""
        return None

    def joined(self, infos: list[dict]) -> None:
        """The ranks joined: read each one's output files (rank.init_rank's "output")."""
        for r, info in enumerate(infos):
            self.output.attach(r, *info["output"])

    def killable(self, pids) -> list[int]:
        """The ranks' pids are this machine's processes."""
        return list(pids)

    def shared_dir(self, state_dir: str) -> str | None:
        """The ranks read the lab's folder as the notebook does."""
        return state_dir

    def ended(self, hosts: list[str]) -> dict[int, str]:
        """Nothing more than their exit codes say (LabProcesses.dead)."""
        return {}

    def interrupt(self, ranks: list[int], sig: int, pids: list[int], signal_engines) -> None:
        """A signal to each rank's process, by pid."""
        for r in ranks:
            try:
                os.kill(pids[r], sig)
            except (OSError, IndexError):
                pass


class RemoteTransport:
    """Ranks elsewhere (see the module docstring)."""

    def __init__(self):
        self.output = ForwardedOutput()

    def output_to(self, listen: str, contact: str, generation: int) -> dict:
        """Where the ranks forward their output (tplab/rank/output_relay.py): this machine's
        receiver, taking output from this start of the ranks only."""
        self.output.expect(generation)
        port = self.output.listen(listen)
        return {"host": contact, "port": port, "key": self.output.key, "generation": generation}

    def joined(self, infos: list[dict]) -> None:
        """Nothing to open: the ranks' output comes to the receiver."""

    def killable(self, pids) -> list[int]:
        """None: a pid on another host means nothing here."""
        return []

    def shared_dir(self, state_dir: str) -> str | None:
        return None

    def ended(self, hosts: list[str]) -> dict[int, str]:
        """rank -> how it ended, for each rank whose forwarded stream closed."""
        return {r: f"exited on {hosts[r] if r < len(hosts) else 'its host'}"
                for r in self.output.ended()}

    def interrupt(self, ranks: list[int], sig: int, pids: list[int], signal_engines) -> None:
        """A signal through ipyparallel (`signal_engines(sig, ranks)`: the engines' nannies)."""
        try:
            signal_engines(sig, ranks)
        except Exception:  # noqa: BLE001 - an engine without a nanny: nothing to do
            pass
