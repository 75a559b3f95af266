"""Entry points of the processes a lab starts: `python -m tplab.lab.entry engine|controller ...`.

Both wrap ipyparallel's own entry points and add two things:
- an owner watch: when the notebook kernel that started the lab dies (even by SIGKILL),
  the process kills its own process group, so nothing outlives the notebook;
- for engines, `import torch.distributed.tensor` in a background thread while the engine
  registers with the controller (the import is most of a rank's start-up time).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

OWNER_ENV = "TPLAB_OWNER"  # "pid:start_time" of the notebook kernel that owns the lab
POLL_S = 0.5


def process_start_time(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/pid/stat), or None.

    Comparing it guards against a new process that reused the owner's pid.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_token(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{pid}:{process_start_time(pid) or ''}"


def _owner_alive(token: str) -> bool:
    pid_s, _, start = token.partition(":")
    pid = int(pid_s)
    if start and os.path.exists("/proc"):
        return process_start_time(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_owner(token: str) -> None:
    while _owner_alive(token):
        time.sleep(POLL_S)
    # The owner is gone: end this process and the children it started (the engine's
    # nanny, the controller's schedulers), which share its process group.
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


def _start_owner_watch() -> None:
    token = os.environ.get(OWNER_ENV)
    if token:
        threading.Thread(target=_watch_owner, args=(token,), daemon=True,
                         name="tplab-owner-watch").start()


def _warm_torch() -> None:
    import torch.distributed.tensor  # noqa: F401


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("engine", "controller"):
        raise SystemExit("usage: python -m tplab.lab.entry engine|controller [ipyparallel args]")
    role, rest = argv[0], argv[1:]
    _start_owner_watch()
    sys.argv = [f"tplab-{role}", *rest]
    if role == "engine":
        threading.Thread(target=_warm_torch, daemon=True, name="tplab-warm-torch").start()
        from ipyparallel.engine.app import main as ipengine

        ipengine()
    else:
        from ipyparallel.controller.app import main as ipcontroller

        ipcontroller()


if __name__ == "__main__":
    main(sys.argv[1:])
