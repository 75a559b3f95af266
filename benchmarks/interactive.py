"""Cells for real work, measured side by side in one run (world 4 by default).

    python benchmarks/interactive.py [--world-size 4] [--repeats 3]

Prints medians and ratios:
- output lag: from a rank's print to the line on the notebook's stdout, for lines every
  rank prints alike (shown once, grouped) and lines that differ per rank; against
  ipyparallel's own `AsyncResult.stream_output()` on a plain ipyparallel cluster of as many
  engines. Goal: a median of 50 ms or less, grouping included.
- a cell printing 10,000 lines per rank, against the same cell with its output discarded
  on the rank. Goal: 1.5x or less.
- the time to report a definite mismatch (`if rank == 0: dist.all_reduce(x)`), against the
  60 s timeout that was the only way to notice it before. Goal: 2 s or less.
- a trivial `lab.run` round trip against raw `apply_sync` on the same engines. Goal: 1.15x.

    python benchmarks/interactive.py --engines [--world-size 4] [--repeats 3]

prints instead the output lag per engine kind, against local ranks in the same run: mpi
(mpiexec on this machine), ssh (two network-namespace hosts, as tests/test_engines.py
makes them) and Slurm (one node); ranks there forward their output (tplab/rank/output_relay.py).
Goal: within 2x of local and under 100 ms. A kind not available here is skipped, saying why.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time

import tplab

LINES = 40
EVERY_S = 0.05


class Arrivals(io.TextIOBase):
    """A stdout that notes when each line arrives."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self.buffer_ = ""

    def write(self, text: str) -> int:
        now = time.time()
        self.buffer_ += text
        *lines, self.buffer_ = self.buffer_.split("\n")
        for line in lines:
            self.times.setdefault(line.split("] ", 1)[-1], now)
        return len(text)

    def flush(self) -> None:
        pass


def printer(start: float, per_rank: bool):
    """Print line i at wall time start + i * EVERY_S, on every rank at the same moments."""
    import time as t

    import torch.distributed as d

    me = d.get_rank()
    for i in range(LINES):
        t.sleep(max(0.0, start + i * EVERY_S - t.time()))
        print(f"rank {me} step {i}" if per_rank else f"step {i}", flush=True)


def lags(arrivals: Arrivals, start: float, per_rank: bool, n: int) -> list[float]:
    out = []
    for i in range(LINES):
        names = [f"rank {r} step {i}" for r in range(n)] if per_rank else [f"step {i}"]
        for name in names:
            if name in arrivals.times:
                out.append(arrivals.times[name] - (start + i * EVERY_S))
    return out


def lab_lag(lab, per_rank: bool) -> float:
    arrivals, old = Arrivals(), sys.stdout
    start = time.time() + 0.5
    sys.stdout = arrivals
    try:
        lab.run(printer, start, per_rank)
    finally:
        sys.stdout = old
    return statistics.median(lags(arrivals, start, per_rank, lab.world_size))


def ipyparallel_lag(n: int) -> float:
    import ipyparallel as ipp

    with ipp.Cluster(n=n, log_level=40) as rc:
        view = rc[:]
        view.apply_sync(lambda: 1)
        arrivals, old = Arrivals(), sys.stdout
        start = time.time() + 0.5
        sys.stdout = arrivals
        try:
            ar = view.apply_async(printer_plain, start, LINES, EVERY_S)
            with ar.stream_output():
                ar.get()
        finally:
            sys.stdout = old
    return statistics.median(lags(arrivals, start, True, n))


def printer_plain(start: float, lines: int, every: float):
    """`printer` for plain engines (no torch.distributed there): rank = engine id. Plain
    ipyparallel runs it in the engine's namespace, so the constants come as arguments."""
    import time as t

    from ipyparallel.engine.app import IPEngine

    me = IPEngine.instance().id
    for i in range(lines):
        t.sleep(max(0.0, start + i * every - t.time()))
        print(f"rank {me} step {i}", flush=True)


def engines_lag(n: int, repeats: int) -> None:
    """Output lag per engine kind against local ranks, medians of `repeats` cells."""
    from launch import engine_kinds

    kinds, why_not, to_stop = engine_kinds(n, slurm=True)
    rows = {}
    try:
        for kind, options in kinds.items():
            with tplab.launch(n, **options) as lab:
                lab_lag(lab, False)  # a first cell warms the path
                rows[kind] = (statistics.median(lab_lag(lab, False) for _ in range(repeats)),
                              statistics.median(lab_lag(lab, True) for _ in range(repeats)))
    finally:
        for thing in to_stop:
            thing.stop()
    local = rows["local"]
    print(f"world size {n}, {repeats} repeats, medians: output lag (lines alike, grouped; "
          "lines per rank)")
    for kind, (same, differ) in rows.items():
        print(f"  {kind:26} {same * 1e3:6.1f} ms ({same / local[0]:.2f}x local), "
              f"{differ * 1e3:6.1f} ms ({differ / local[1]:.2f}x local)  "
              "(goal <= 2x local, < 100 ms)")
    for kind, why in why_not.items():
        print(f"  {kind:26} skipped: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", action="store_true",
                        help="output lag per engine kind (mpi, ssh, slurm) against local")
    args = parser.parse_args()
    n, k = args.world_size, args.repeats
    if args.engines:
        engines_lag(n, k)
        return
    print(f"world size {n}, {k} repeats, medians")
    base = ipyparallel_lag(n)
    with tplab.launch(n) as lab:
        same = statistics.median(lab_lag(lab, False) for _ in range(k))
        differ = statistics.median(lab_lag(lab, True) for _ in range(k))
        print(f"output lag: lab {same * 1e3:.1f} ms (lines alike, grouped), "
              f"{differ * 1e3:.1f} ms (lines per rank); ipyparallel stream_output "
              f"{base * 1e3:.1f} ms; ratio {same / base:.2f}x, {differ / base:.2f}x "
              "(goal <= 50 ms)")
        loud = "for i in range(10000):\n    print(f'line {i} of a long cell')"
        # discarded at the fd: the same line-by-line writes, to /dev/null (what carrying the
        # output to the notebook costs); and never written (print into a StringIO)
        at_fd = ("import contextlib, os\nwith open(os.devnull, 'w', buffering=1) as f, "
                 "contextlib.redirect_stdout(f):\n    for i in range(10000):\n"
                 "        print(f'line {i} of a long cell')")
        quiet = ("import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n"
                 "    for i in range(10000):\n        print(f'line {i} of a long cell')")
        t_loud, t_fd, t_quiet = [], [], []
        for _ in range(k):
            for code, out in ((loud, t_loud), (at_fd, t_fd), (quiet, t_quiet)):
                sink, old = io.StringIO(), sys.stdout
                sys.stdout = sink
                t = time.perf_counter()
                try:
                    lab.execute(code)
                finally:
                    sys.stdout = old
                out.append(time.perf_counter() - t)
                if code is loud:
                    assert sink.getvalue().count("of a long cell") == 10000, "lines lost"
        a, f, b = (statistics.median(x) for x in (t_loud, t_fd, t_quiet))
        print(f"10,000 lines per rank: shown {a:.3f} s; discarded at the rank's fd {f:.3f} s, "
              f"ratio {a / f:.2f}x (goal <= 1.5x); never written {b:.3f} s, ratio {a / b:.2f}x")
        report = []
        for _ in range(k):
            t = time.perf_counter()
            try:
                lab.execute("x = torch.ones(8)\nif rank == 0:\n    dist.all_reduce(x)")
            except tplab.CollectiveHang:
                report.append(time.perf_counter() - t)
        r = statistics.median(report)
        print(f"definite mismatch reported in {r:.2f} s, against the {lab.timeout:.0f} s "
              f"timeout: ratio {r / lab.timeout:.3f}x (goal <= 2 s)")
        view = lab._client[lab._engine_ids]  # raw ipyparallel on the same engines
        view.block = True
        trivial_times: tuple[list, list] = ([], [])
        for i in range(105):
            for fn, out in ((lambda: lab.run(trivial), trivial_times[0]),
                            (lambda: view.apply_sync(trivial), trivial_times[1])):
                t = time.perf_counter()
                fn()
                if i >= 5:  # the first calls warm both paths
                    out.append(time.perf_counter() - t)
        a, b = (statistics.median(x) for x in trivial_times)
        print(f"round trip of a trivial call: lab.run {a * 1e3:.1f} ms, raw apply_sync "
              f"{b * 1e3:.1f} ms, ratio {a / b:.2f}x (goal <= 1.15x)")


def trivial():
    return 1


if __name__ == "__main__":
    main()
