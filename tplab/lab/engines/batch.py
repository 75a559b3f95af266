"""Ranks in a batch job (ipyparallel's batch launchers: PBS, SGE, LSF, HTCondor, and the
generic "batch"): the job runs elsewhere, so no pid is local; the lab cancels the job
(the launcher's delete command) at shutdown, and while the ranks start it reads the job's
output file for a fatal line and asks the batch system whether the job is still queued
(`job_queued`: a kind for a known batch system says how; slurm.py does).
"""

from __future__ import annotations

import subprocess

from ipyparallel.cluster.launcher import BatchSystemLauncher

from tplab.lab.engines import watch
from tplab.lab.engines.kind import EngineKind


class BatchKind(EngineKind):
    name = "batch"
    launcher_base = BatchSystemLauncher

    def local_pids(self, engine_set) -> list[int]:
        return []

    def stop(self, engine_sets, timeout: float = 10.0) -> None:
        for engine_set in engine_sets:
            job = getattr(engine_set, "job_id", "")
            if job:
                try:
                    subprocess.run([*engine_set.delete_command, str(job)],
                                   capture_output=True, timeout=timeout)
                except (OSError, subprocess.TimeoutExpired):
                    pass  # best effort at shutdown

    def job_queued(self, job_id: str) -> bool:
        """Whether the batch system still has the job (queued or running); True when this
        kind cannot tell (then only a fatal line in the job's output says it failed)."""
        return True

    def check(self, engine_set, remote: bool, state_dir: str) -> str | None:
        if not isinstance(engine_set, BatchSystemLauncher):
            return super().check(engine_set, remote, state_dir)
        name = type(engine_set).__name__
        lines = watch.tail(engine_set.output_file)
        fatal = watch.fatal_part(lines)
        if fatal:
            return watch.message(f"the engines of batch job {engine_set.job_id} ({name}) "
                                 "failed", fatal, engine_set.output_file, state_dir)
        if remote and engine_set.job_id and not self.job_queued(str(engine_set.job_id)):
            return watch.message(f"batch job {engine_set.job_id} ({name}) ended before its "
                                 "engines registered",
                                 lines[-12:] or ["(the job wrote no output)"],
                                 engine_set.output_file, state_dir)
        return None


KIND = BatchKind
