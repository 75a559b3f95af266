"""Checking processes by pid in tests: which are still running (zombies count as gone)."""

from __future__ import annotations

import time

import psutil


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, seconds: float) -> list[int]:
    """Wait up to `seconds` for every pid to exit; return those still running."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)
