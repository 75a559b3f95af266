"""Checks on what a user asks the lab for, made before anything is started."""

from __future__ import annotations

import difflib
import numbers
import os
import re
import socket
import subprocess
import sys

import psutil

from tplab.errors import LabError
from tplab.lab.addresses import EVERY_INTERFACE

# this package's folder and its __init__.py (not `import tplab`: tplab imports this module)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_INIT = os.path.join(PACKAGE_DIR, "__init__.py")

BACKENDS = ("auto", "gloo", "nccl")
# Memory a local rank holds (PSS: a shared page counts 1/k to each of its k sharers), from
# benchmarks/rank_memory.py after a DTensor MLP step, torch 2.13 CPU: forked from the fork
# server 135-156 MiB (they share torch's pages), started anew (fork=False) 244-257 MiB plus
# its nanny; with about 30% headroom:
RANK_MEMORY_GIB = {"forked": 0.2, "started": 0.35}
MAX_LOCAL_RANKS = 64


def gpu_count() -> int:
    """GPUs this machine has (torch.cuda; 0 without CUDA)."""
    # deferred: `import tplab` in a notebook loads this module (tplab.lab.magics)
    # and takes 0.014 s; torch would add 2-3 s
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"world_size must be an int (the number of ranks), "
                        f"got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise LabError(f"world_size must be at least 1, got {world_size}")
    return int(world_size)


def closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def split_cluster_options(options: dict, keywords=()) -> dict:
    """Keywords that are not tplab's: ipyparallel.Cluster traits pass, others are refused
    with the closest valid name among `keywords` (tplab's own) and the traits (a typo such
    as timout= must not pass silently)."""
    # deferred: `import tplab` in a notebook loads this module (tplab.lab.magics)
    # and takes 0.014 s; ipyparallel would add 0.07 s there (0.45 s without IPython)
    import ipyparallel as ipp

    traits = set(ipp.Cluster.class_trait_names())
    for name in options:
        if name not in traits:
            raise TypeError(f"tplab.launch() got an unknown keyword {name!r}"
                            f"{closest(name, [*keywords, *sorted(traits)])} "
                            "(options for ipyparallel.Cluster go in cluster_options={...})")
    return dict(options)


def check_threads(threads) -> int | None:
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"threads_per_rank must be a whole number of threads >= 1 (or None "
                         f"for cores // world_size), got {threads!r}")
    return int(threads)


def check_ip(ip) -> None:
    """The address the lab listens on must be one of this machine's (or every interface)."""
    if not isinstance(ip, str) or not ip:
        raise LabError(f"ip must be an address string such as '127.0.0.1', got {ip!r}")
    if ip in EVERY_INTERFACE:
        return
    try:
        address = socket.gethostbyname(ip)
    except OSError:
        raise LabError(f"ip={ip!r} is not an address or a host name this machine knows") \
            from None
    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    if address not in mine and not address.startswith("127."):
        raise LabError(f"ip={ip!r} is not an address of this machine, so the lab could not "
                         f"listen on it; this machine's addresses are "
                         f"{', '.join(sorted(a for a in mine if '.' in a))} "
                         "(or ip='0.0.0.0' for every interface)")


def check_ranks(ranks, world_size: int) -> list[int]:
    """ranks=None (every rank), an int, or a list of distinct rank numbers, in the order
    the results should come back."""
    if ranks is None:
        return list(range(world_size))
    if isinstance(ranks, bool) or isinstance(ranks, str | bytes):
        raise TypeError(f"ranks must be a rank number or a list of them, got {ranks!r}")
    if isinstance(ranks, numbers.Integral):
        ranks = [ranks]
    try:
        ranks = list(ranks)
    except TypeError:
        raise TypeError(f"ranks must be a rank number or a list of them, got {ranks!r}") \
            from None
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)
           or not 0 <= r < world_size]
    if bad or not ranks:
        raise ValueError(f"ranks must be rank numbers from 0 to {world_size - 1}, got {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks lists a rank twice: {ranks!r}")
    return [int(r) for r in ranks]


def parse_rank_spec(line: str, world_size: int) -> list[int]:
    """%%rank's argument: "0", "0,2", "0 2", "1-3" (mixed too: "0, 2-3")."""
    forms = "%%rank 0,2 or %%rank 0 2 or %%rank 1-3"
    ranks: list[int] = []
    for part in [p for p in re.split(r"[,\s]+", line.strip()) if p]:
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"%%rank takes rank numbers, got {line.strip()!r}: use {forms}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"%%rank range {part!r} runs backwards: write {hi}-{lo}")
        ranks.extend(range(lo, hi + 1))
    if not ranks:
        raise ValueError(f"%%rank needs the ranks to run on: {forms}")
    bad = sorted({r for r in ranks if r >= world_size})
    if bad:
        raise ValueError(f"%%rank {line.strip()}: this lab has ranks 0 to {world_size - 1} "
                         f"(no rank {', '.join(map(str, bad))})")
    return list(dict.fromkeys(ranks))


def check_launch_args(world_size, backend, ip, fork: bool = True) -> None:
    """What `tplab.launch` checks before it resolves `engines=` (engines.kind_for does that,
    and the kind checks what it can run)."""
    check_world_size(world_size)
    if backend not in BACKENDS:
        raise LabError(f"unknown backend {backend!r}: use one of {', '.join(map(repr, BACKENDS))}")
    check_ip(ip)
    if not isinstance(fork, bool):
        raise TypeError(f"fork must be True or False, got {fork!r}")
    check_no_shadowing_folder(os.getcwd())
    # what a kind itself can run (local ranks: this machine's memory and GPUs) is checked
    # by the kind (`EngineKind.check_size`)


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" -> NCCL when every local rank can have its own GPU, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if gpu_count() >= world_size else "gloo"


def check_timeout(timeout, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"{name} must be a positive number of seconds (or None), "
                         f"got {timeout!r}")
    return float(timeout)


def shadowing_folder(directory: str) -> str | None:
    """The folder `directory`/tplab if a Python started there (a rank: `python -m
    tplab.rank.entry`, the working directory first on its sys.path) would import it in
    place of this package: a checkout's root, or a folder without __init__.py that it takes
    for an empty namespace package (an editable install's finder comes after the path's).
    Asked of such a Python itself (only when there is such a folder), as its sys.path is not
    this process's. Else None."""
    folder = os.path.join(os.path.abspath(directory), "tplab")
    if not os.path.isdir(folder) or os.path.samefile(folder, PACKAGE_DIR):
        return None
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec("
                               "'tplab').origin)"],
        cwd=directory, capture_output=True, text=True, timeout=120).stdout.strip()
    same = os.path.isfile(found) and os.path.samefile(found, PACKAGE_INIT)
    return None if same else folder


def check_no_shadowing_folder(directory: str) -> None:
    """A LabError naming a folder that would shadow tplab on the ranks (`shadowing_folder`),
    before any rank is started (they would fail with "No module named 'tplab.rank'")."""
    folder = shadowing_folder(directory)
    if folder:
        raise LabError(
            f"the folder {folder} in the working directory shadows the tplab package: the "
            "ranks, started here, would import it instead (a checkout's root, or a folder "
            "without __init__.py that Python takes for an empty namespace package). Run the "
            "notebook from another directory (%cd there, or inside the checkout), or rename "
            "the folder")
