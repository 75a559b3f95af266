"""The platforms learners bring, and what the lab does on each: decisions made here, by
small functions of a `Platform`, so that each one is unit-tested on any machine.

| platform    | what goes wrong                                   | what the lab does            |
|-------------|---------------------------------------------------|------------------------------|
| macOS       | forking after torch is imported crashes the child | no fork server: `fork=False` |
|             | (objc_initializeAfterForkError; Lightning-AI/     | (ipyparallel starts engines) |
|             | pytorch-lightning #21345); gloo resolves `.local` | rendezvous on 127.0.0.1, gloo|
|             | hostnames badly                                   | on the loopback (lo0)        |
| Windows     | no fork; torch's TCPStore defaults to libuv, which| no fork server; USE_LIBUV=0  |
|             | Windows wheels lack (pytorch #148266)             | and use_libuv=False; gloo    |
| Colab       | 2 cores, at most one GPU; its torch must be kept  | world size 2 suggested; no   |
|             |                                                   | torch pin (pyproject `>=`)   |
| JupyterHub  | engines started from PATH may be another Python   | engines run sys.executable   |
|             | (ipyparallel #131, #221)                          | (the kernel's own Python)    |
| containers  | /dev/shm defaults to 64 MiB; NCCL fails with that | the doctor says so and how   |
|             |                                                   | to fix (--shm-size=1g)       |

`detect()` reads the machine; everything else takes the `Platform` it returns.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import psutil

MiB = 2**20
SHM_NEEDED = 512 * MiB  # NCCL's shared-memory transport wants far more than Docker's 64 MiB


@dataclass(frozen=True)
class Platform:
    """What the lab needs to know about where it runs."""

    system: str = "linux"            # "linux", "macos" or "windows"
    colab: bool = False
    jupyterhub: bool = False
    container: bool = False
    shm_bytes: int | None = None     # size of /dev/shm, None where there is none
    cpus: int = 1
    gpus: int = 0
    loopback: str | None = "lo"      # the interface that holds 127.0.0.1
    executable: str = field(default_factory=lambda: sys.executable)


def system_name(platform_str: str | None = None) -> str:
    """sys.platform -> "linux", "macos", "windows" (anything else counts as linux)."""
    p = platform_str or sys.platform
    if p == "darwin":
        return "macos"
    if p.startswith(("win", "cygwin")):
        return "windows"
    return "linux"


def _in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        with open("/proc/1/cgroup") as f:
            text = f.read()
    except OSError:
        return False
    return any(word in text for word in ("docker", "kubepods", "containerd", "lxc"))


def _shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return None
    return st.f_frsize * st.f_blocks


def _loopback() -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _gpus() -> int:
    try:
        # deferred: `python -m tplab doctor` loads this module and reports a torch that
        # cannot load (tplab/checks/doctor.py) instead of failing before it prints anything
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect() -> Platform:
    """The platform this process runs on."""
    env = os.environ
    return Platform(
        system=system_name(),
        colab="google.colab" in sys.modules or "COLAB_RELEASE_TAG" in env,
        jupyterhub=any(k in env for k in ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_USER")),
        container=_in_container(),
        shm_bytes=_shm_bytes(),
        cpus=os.cpu_count() or 1,
        gpus=_gpus(),
        loopback=_loopback(),
    )


# --- the decisions -----------------------------------------------------------------------


def default_fork(p: Platform | None = None) -> bool:
    """Whether local ranks are forked from the lab's fork server by default: on Linux only.

    macOS: a child forked after torch (and so the Objective-C runtime) is loaded can die in
    objc_initializeAfterForkError (Lightning-AI/pytorch-lightning #21345). Windows has no
    fork. Both start each engine as a fresh process (ipyparallel's own launcher).
    """
    p = p or detect()
    return p.system == "linux"


def rendezvous_host(p: Platform | None = None) -> str:
    """Where rank 0's TCPStore listens for a local lab: always the IPv4 loopback, never the
    hostname (gloo resolves macOS `.local` names to an interface it cannot reach)."""
    return "127.0.0.1"


def rank_env(p: Platform | None = None) -> dict[str, str]:
    """Environment variables every local rank gets, by platform.

    GLOO_SOCKET_IFNAME pins gloo to the loopback interface ("lo" on Linux, "lo0" on macOS)
    instead of the one its hostname resolves to. On Windows USE_LIBUV=0: torch's TCPStore
    uses libuv by default, which Windows wheels are built without (pytorch #148266).
    """
    p = p or detect()
    env: dict[str, str] = {}
    if p.loopback:
        env["GLOO_SOCKET_IFNAME"] = p.loopback
    if p.system == "windows":
        env["USE_LIBUV"] = "0"
    return env


def store_options(p: Platform | None = None) -> dict:
    """Keyword arguments for `torch.distributed.TCPStore` on this platform."""
    p = p or detect()
    return {"use_libuv": False} if p.system == "windows" else {}


def engine_python(p: Platform | None = None) -> str:
    """The Python the engines run: the kernel's own. On JupyterHub an `ipengine` found on
    PATH may belong to another environment (ipyparallel #131, #221)."""
    p = p or detect()
    return p.executable


def suggested_world_size(p: Platform | None = None) -> int:
    """The world size notebooks should start with: 4, or 2 on a 2-core machine (Colab)."""
    p = p or detect()
    return 2 if p.cpus <= 2 or p.colab else 4


@dataclass(frozen=True)
class Note:
    """One thing about this platform a teacher or learner should know; `problem` when the
    lab cannot work as it is, with `fix` saying what to do."""

    name: str
    text: str
    problem: bool = False
    fix: str = ""


def notes(p: Platform | None = None, *, nccl: bool | None = None) -> list[Note]:
    """The platform notes that apply to `p` (the doctor prints them). `nccl`: whether the
    ranks would use NCCL (default: when there is a GPU); only then is /dev/shm a problem."""
    p = p or detect()
    nccl = p.gpus > 0 if nccl is None else nccl
    out: list[Note] = []
    if p.system == "macos":
        out.append(Note("macOS", "ranks start as fresh processes (no fork server: forking "
                        "after torch is imported crashes on macOS); rendezvous on 127.0.0.1"
                        + (f", gloo on {p.loopback}" if p.loopback else "")))
    if p.system == "windows":
        out.append(Note("Windows", "gloo without libuv (USE_LIBUV=0), ranks start as fresh "
                        "processes; the %%ranks magics and every notebook work, NCCL does not"))
    if p.colab:
        out.append(Note("Colab", f"{p.cpus} cores: use world_size=2; keep Colab's own torch "
                        "(tplab needs torch>=2.6 and never replaces it)"))
    if p.jupyterhub:
        out.append(Note("JupyterHub", f"engines run the kernel's own Python ({p.executable})"))
    if p.container:
        out.append(Note("container", "running in a container"))
    if p.shm_bytes is not None and p.shm_bytes < SHM_NEEDED:
        size = f"/dev/shm is {p.shm_bytes / MiB:.0f} MiB"
        if nccl:
            out.append(Note("shared memory", f"{size}: NCCL fails with that", problem=True,
                            fix="start the container with --shm-size=1g (docker run) or "
                                "mount a larger /dev/shm (Kubernetes: an emptyDir with "
                                "medium: Memory)"))
        else:
            out.append(Note("shared memory", f"{size}: fine for gloo on CPU; NCCL on GPUs "
                            "would need --shm-size=1g"))
    if p.loopback is None:
        out.append(Note("network", "no interface holds 127.0.0.1: ranks cannot rendezvous",
                        problem=True, fix="bring up the loopback interface (ip link set lo "
                                          "up), or run the container without --network=none"))
    return out
