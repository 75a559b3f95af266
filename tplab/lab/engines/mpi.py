"""MPI ranks: one `mpiexec` (a local process) starts every engine, perhaps on other hosts
(a hostfile). Engine ids are first_id + MPI rank (tplab/rank/entry.py), so each start of the
ranks has ids of its own; mpiexec does not forward the environment to other hosts, so the
lab names every variable it needs (`-x NAME`, Open MPI; `-genvlist`, MPICH). Ending
mpiexec ends the ranks on every host (its orteds do). See docs/CLUSTER.md, "MPI"."""

from __future__ import annotations

import subprocess

from ipyparallel.cluster.launcher import MPILauncher

from tplab.lab.engines.kind import EngineKind
from tplab.rank.entry import FIRST_ID_ENV


class MPIKind(EngineKind):
    name = "mpi"
    launcher_base = MPILauncher
    local_rank_vars = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")

    def configure(self, config, env: dict, state_dir: str) -> None:
        super().configure(config, env, state_dir)
        names = [*env, "IPP_CLUSTER_ID", "IPP_PROFILE_DIR", FIRST_ID_ENV]
        try:
            version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True,
                                     timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            version = ""
        if "Open MPI" in version or "OpenRTE" in version:
            config.MPILauncher.mpi_cmd = ["mpiexec", *(a for n in names for a in ("-x", n))]
        elif version:  # MPICH / Intel MPI (Hydra)
            config.MPILauncher.mpi_cmd = ["mpiexec", "-genvlist", ",".join(names)]

    def start_options(self, first_id: int, env: dict) -> dict:
        return {"environment": {**env, FIRST_ID_ENV: str(first_id)}}

    def engine_ids(self, first_id: int, n: int) -> list[int]:
        return [first_id + r for r in range(n)]  # first_id + MPI rank (tplab/rank/entry.py)


KIND = MPIKind
