"""Checks on what a user asks the lab for, made before anything is started."""

from __future__ import annotations

import numbers

import psutil

from tplab.errors import LabError

BACKENDS = ("auto", "gloo", "nccl")
RANK_MEMORY_GIB = 0.5  # a rank that imported torch.distributed.tensor holds about this much
MAX_LOCAL_RANKS = 64


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_launch_args(world_size, backend, engines, ip) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"world_size must be an int (the number of ranks), "
                        f"got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise LabError(f"world_size must be at least 1, got {world_size}")
    if backend not in BACKENDS:
        raise LabError(f"unknown backend {backend!r}: use one of {', '.join(map(repr, BACKENDS))}")
    if isinstance(engines, str):
        from ipyparallel.cluster.launcher import find_launcher_class

        if engines.lower() != "local":
            try:
                find_launcher_class(engines, "engine")
            except Exception:
                from importlib.metadata import entry_points

                names = sorted(e.name for e in entry_points(group="ipyparallel.engine_launchers"))
                raise LabError(f"unknown engines {engines!r}: use 'local' or one of "
                               f"ipyparallel's engine launchers: {', '.join(names)}") from None
    elif not isinstance(engines, type):
        raise LabError(f"engines must be a launcher name such as 'local' or 'mpi', "
                       f"got {engines!r}")
    if not isinstance(ip, str) or not ip:
        raise LabError(f"ip must be an address string such as '127.0.0.1', got {ip!r}")
    if engines == "local":
        available = psutil.virtual_memory().available / 2**30
        most = int(min(MAX_LOCAL_RANKS, available // RANK_MEMORY_GIB))
        if world_size > most:
            raise LabError(
                f"world_size={world_size} is more than this machine can run: each rank needs "
                f"about {RANK_MEMORY_GIB} GiB and {available:.1f} GiB is available, so at most "
                f"{most} local ranks (tplab caps local ranks at {MAX_LOCAL_RANKS})")
    if backend == "nccl" and engines == "local":
        gpus = _gpu_count()
        if gpus < world_size:
            raise LabError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                           f"but this machine has {gpus} GPU(s); use backend='gloo' (CPU) "
                           f"or 'auto'")


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" -> NCCL when every local rank can have its own GPU, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if _gpu_count() >= world_size else "gloo"


def check_timeout(timeout, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"{name} must be a positive number of seconds (or None), "
                         f"got {timeout!r}")
    return float(timeout)
