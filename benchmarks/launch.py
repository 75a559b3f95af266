"""Start-up, round trip and transfer of tplab.launch, against baselines measured in the same run.

    python benchmarks/launch.py [--world-size 4] [--repeats 3]

Prints medians and ratios (lab / baseline):
- launch to the first all-reduce done, against the floor: N bare processes started at
  once that import torch.distributed.tensor, join a gloo group, all-reduce once and exit
  (timed until all have exited). Goal: <= 1.0x at world size 4.
- round trip of a trivial lab.run, against raw ipyparallel apply_sync on the same
  engines. Goal: <= 1.15x.
- a 4 MB tensor from every rank, against pulling the same data as numpy arrays through
  raw ipyparallel. Goal: <= 1.5x.

    python benchmarks/launch.py --engines [--world-size 4] [--repeats 3]

prints instead the launch time (to the first all-reduce done) through other launchers,
against local engines in the same run: engines="mpi" (mpiexec on this machine) and
engines="ssh" (two test hosts in network namespaces with sshd, as tests/test_engines.py
makes them; needs root). A launcher that is not available here is skipped, saying why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch

import tplab

BARE_RANK = """
import os, torch, torch.distributed as dist, torch.distributed.tensor
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def floor_seconds(n: int) -> float:
    """N bare processes at once, until every one has exited."""
    port = free_port()
    threads = str(max(1, (os.cpu_count() or 1) // n))
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", BARE_RANK], env={
        **os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "OMP_NUM_THREADS": threads}) for r in range(n)]
    codes = [p.wait() for p in procs]
    assert codes == [0] * n, codes
    return time.perf_counter() - started


def allreduce_one():
    import torch.distributed as dist

    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def lab_seconds(n: int) -> tuple[float, tplab.Lab]:
    started = time.perf_counter()
    lab = tplab.launch(n)
    assert lab.run(allreduce_one) == [float(n)] * n
    return time.perf_counter() - started, lab


def trivial():
    return 1


def uses_rank_names():
    return w.numel() * rank  # noqa: F821 - rank and w are the ranks' own names


def four_mb_tensor():
    return torch.ones(1024 * 1024)  # 4 MB of float32


def four_mb_numpy():
    import numpy

    return numpy.ones(1024 * 1024, dtype=numpy.float32)


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Median seconds of fn_a and of fn_b, called alternately so both see the same load."""
    times: tuple[list, list] = ([], [])
    for _ in range(repeats):
        for fn, out in ((fn_a, times[0]), (fn_b, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def launch_seconds(n: int, **options) -> float:
    started = time.perf_counter()
    with tplab.launch(n, **options) as lab:
        assert lab.run(allreduce_one) == [float(n)] * n
        return time.perf_counter() - started


def engine_kinds(n: int, slurm: bool = False) -> tuple[dict, dict, list]:
    """name -> tplab.launch keywords of each engine kind available here (local, mpi on
    this machine, ssh over two namespace hosts, Slurm on one node when asked); why each
    other kind is not; and what to stop afterwards (the hosts, the Slurm cluster)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from hosts import Hosts, Slurm, skip_reason

    kinds: dict[str, dict] = {"local": {}}
    why_not, to_stop = {}, []
    if not shutil.which("mpiexec"):
        why_not["mpi"] = "mpiexec not found (apt-get install openmpi-bin)"
    else:
        try:
            import mpi4py  # noqa: F401

            os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            kinds["mpi (this machine)"] = {"engines": "mpi", "cluster_options": {
                "config": {"MPILauncher": {"mpi_args": ["--oversubscribe"]}}}}
        except ImportError:
            why_not["mpi"] = 'mpi4py missing: pip install "tplab[mpi]"'
    reason = skip_reason("ip", "sshd", "ssh", "ssh-keygen")
    if reason:
        why_not["ssh"] = reason
    else:
        hosts = Hosts(2).start()
        to_stop.append(hosts)
        hosts.start_sshd()
        per_host = {a: (n + 1) // 2 for a in hosts.addresses}
        kinds["ssh (2 namespace hosts)"] = {"engines": "ssh", "ip": hosts.controller,
                                            "cluster_options": {"config": {
            "SSHEngineSetLauncher": {"engines": per_host},
            "SSHLauncher": {"ssh_cmd": ["ssh", "-F", hosts.ssh_config],
                            "scp_cmd": ["scp", "-F", hosts.ssh_config]}}}}
    if slurm:
        reason = skip_reason("slurmctld", "slurmd", "munged", "sbatch")
        if reason:
            why_not["slurm"] = reason
        else:
            cluster = Slurm(cpus=max(4, n)).start()
            to_stop.append(cluster)
            os.environ.update(cluster.env)
            kinds["slurm (one node)"] = {"engines": "slurm"}
    return kinds, why_not, to_stop


def engines_comparison(n: int, repeats: int) -> None:
    """Launch time through mpi and ssh against local engines, medians of `repeats`."""
    kinds, why_not, to_stop = engine_kinds(n)
    try:
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(repeats):  # interleaved, so every launcher sees the same load
            for kind, options in kinds.items():
                times[kind].append(launch_seconds(n, **options))
    finally:
        for thing in to_stop:
            thing.stop()
    local = statistics.median(times["local"])
    print(f"world size {n}, {repeats} repeats, medians: launch to the first all-reduce")
    for kind, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {kind:26} {median:6.2f} s  ({median / local:.2f}x local)")
    for kind, why in why_not.items():
        print(f"  {kind:26} skipped: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", action="store_true",
                        help="launch time through mpi and ssh against local engines")
    args = parser.parse_args()
    n = args.world_size
    if args.engines:
        engines_comparison(n, args.repeats)
        return
    floors, labs_s = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        floors.append(floor_seconds(n))
        seconds, lab = lab_seconds(n)
        labs_s.append(seconds)
        lab.shutdown()
    floor, launch = statistics.median(floors), statistics.median(labs_s)
    print(f"world size {n}, {args.repeats} repeats, medians")
    print(f"launch to first all-reduce: lab {launch:.2f} s, floor {floor:.2f} s, "
          f"ratio {launch / floor:.2f}x (goal <= 1.0x)")

    with tplab.launch(n) as lab:
        view = lab._client[lab._engine_ids]
        view.block = True
        for _ in range(5):  # warm both paths
            lab.run(trivial)
            view.apply_sync(trivial)
        rt_lab, rt_raw = timed_pair(lambda: lab.run(trivial),
                                    lambda: view.apply_sync(trivial), 100)
        print(f"round trip of a trivial call: lab.run {rt_lab * 1e3:.1f} ms, raw apply_sync "
              f"{rt_raw * 1e3:.1f} ms, ratio {rt_lab / rt_raw:.2f}x (goal <= 1.15x)")
        # Names resolve on the ranks: a notebook function using `rank` and a pushed 4 MB `w`
        # (neither travels with the call), against the same trivial raw call.
        lab.push({"w": torch.ones(1024 * 1024)})
        global w
        w = torch.zeros(1024 * 1024)  # the notebook's own w, which must stay home
        names_lab, names_raw = timed_pair(lambda: lab.run(uses_rank_names),
                                          lambda: view.apply_sync(trivial), 100)
        assert lab.run(uses_rank_names) == [2**20 * r for r in range(n)]
        print(f"round trip, names resolved on the ranks (rank, a pushed 4 MB w): lab.run "
              f"{names_lab * 1e3:.1f} ms, raw apply_sync {names_raw * 1e3:.1f} ms, ratio "
              f"{names_lab / names_raw:.2f}x (goal <= 1.15x)")
        big_lab, big_raw = timed_pair(lambda: lab.run(four_mb_tensor),
                                      lambda: view.apply_sync(four_mb_numpy), 20)
        print(f"4 MB tensor from {n} ranks: lab.run {big_lab * 1e3:.1f} ms, raw numpy "
              f"{big_raw * 1e3:.1f} ms, ratio {big_lab / big_raw:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
