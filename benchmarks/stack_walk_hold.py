"""How often a tensor outlives `del` and one gc.collect() after an all-reduce, with and
without a thread walking the main thread's stack as the reporter does, in one run.

    python benchmarks/stack_walk_hold.py [--calls 500]

Two gloo ranks on 127.0.0.1 all-reduce a small tensor `--calls` times, first alone, then
with a thread beside them that walks `sys._current_frames()` as
tplab.rank.whereabouts.where_now does: it holds each frame while it reads the frame's source
line (and its f_locals: here on every frame, where_now on a collective's only). Prints,
per rank and round, how many tensors were still alive after the first collect and how
many outlived 10 s. The walker holds the collective's frame only while it walks: some
tensors outlive the first collect, none outlive 10 s (tests/test_faults.py's
test_a_noted_collective_keeps_no_tensor_alive waits for that reason).
"""

from __future__ import annotations

import argparse
import gc
import linecache
import os
import socket
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def walk(main: int, stop: threading.Event) -> None:
    while not stop.is_set():
        frame = sys._current_frames().get(main)
        while frame is not None:
            frame.f_locals  # noqa: B018 - read as where_now reads a collective's shape
            linecache.getline(frame.f_code.co_filename, frame.f_lineno or 0)
            frame = frame.f_back
        time.sleep(0.0005)


def count(calls: int) -> tuple[int, int]:
    first = later = 0
    for _ in range(calls):
        x = torch.ones(3, 5)
        dist.all_reduce(x)
        gone = weakref.ref(x)
        del x
        gc.collect()
        if gone() is not None:
            first += 1
            deadline = time.monotonic() + 10
            while gone() is not None and time.monotonic() < deadline:
                time.sleep(0.001)
                gc.collect()
            later += gone() is not None
    return first, later


def rank_main(rank: int, port: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for walker in (False, True):
        stop = threading.Event()
        if walker:
            threading.Thread(target=walk, args=(threading.main_thread().ident, stop),
                             daemon=True).start()
        dist.barrier()
        first, later = count(calls)
        stop.set()
        print(f"rank {rank}, {'with' if walker else 'without'} a stack walker: {first} of "
              f"{calls} outlived the first collect, {later} outlived 10 s", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, args.calls), nprocs=2)


if __name__ == "__main__":
    main()
