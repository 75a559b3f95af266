"""Slurm ranks: ipyparallel's sbatch + srun launcher. The batch script goes to the lab's
folder (not the notebook's working directory), what sbatch says on failure is kept (a
refused job is reported at once, with the fix), and `squeue` says whether the job left the
queue while its engines start. See docs/CLUSTER.md, "Slurm"."""

from __future__ import annotations

import os
import subprocess

from ipyparallel.cluster.launcher import SlurmLauncher

from tplab.lab.engines import watch
from tplab.lab.engines.batch import BatchKind

LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "RESIZING", "SUSPENDED")


class SlurmKind(BatchKind):
    name = "slurm"
    launcher_base = SlurmLauncher
    local_rank_vars = ("SLURM_LOCALID",)  # srun's: this task's index on its node

    def configure(self, config, env: dict, state_dir: str) -> None:
        super().configure(config, env, state_dir)
        errors = watch.submit_errors(state_dir)
        os.makedirs(os.path.dirname(errors), mode=0o700, exist_ok=True)
        config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
            state_dir, "slurm_engine.sbatch")
        config.SlurmLauncher.submit_command = [  # sbatch's errors kept (ipyparallel drops them)
            "sh", "-c", 'sbatch "$@" 2>"$0"; s=$?; cat "$0" >&2; exit $s', errors]

    def job_queued(self, job_id: str) -> bool:
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                                 capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return True  # cannot tell: do not call it failed
        if out.returncode != 0:
            return "Invalid job id" not in out.stderr  # an error other than "gone": unknown
        return out.stdout.strip() in LIVE_STATES


KIND = SlurmKind
