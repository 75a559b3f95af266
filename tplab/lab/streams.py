"""Live output: what every rank writes, shown in the notebook while the cell runs.

Each rank's fds 1 and 2 point at two files of its own (tplab/rank/entry.py), so everything
a rank writes lands there: print, os.write, subprocesses, C++ warnings, threads, a crash
report. `RankFiles` reads those files as they grow; `LiveOutput` turns the text into
labelled lines:
- a line that several ranks print at the same place is shown once, as `[ranks 0-3] ...`,
  when every rank has printed it (or, for lines that differ, at once, or after `window`);
  by line order, not by the clock alone: while a silent rank has printed fewer lines than
  the line's place (it has not reached that line yet: a loaded machine, 4 ranks on 2
  cores, or engines on other hosts), the line waits the long window, which grows with the
  lag seen between ranks printing the same line in this cell (MAX_WINDOW_S at once for a
  rank that printed lines alike with the line's rank: it prints the same lines, later; a
  line one rank alone prints then waits for the others' next line); only a rank that has
  got past that place gets the short one;
- carriage-return progress (a plain tqdm bar) is one line per rank, updated in place (a
  display in Jupyter; its last state only elsewhere).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import IPython.display
from IPython import get_ipython

from tplab.errors import format_rank_list

WINDOW_S = 0.03  # how long a line waits for the same line from the other ranks
ALIKE_WINDOW_S = 1.0  # ... from a rank behind in line order, or last shown with it (at least)
LAG_FACTOR = 4  # ... or this many times the largest lag seen between ranks' same lines
MAX_WINDOW_S = 10.0
PROGRESS_EVERY_S = 0.1


_KERNEL: list[bool] = []

# Lines that are data for the notebook, not text for the learner: {marker: handler(rank,
# line)}. A complete line holding a marker goes to its handler instead of the output
# (tplab.train_check's live figure: one line per step and rank).
LINE_HANDLERS: dict[str, object] = {}


def in_kernel() -> bool:
    """True inside a Jupyter kernel, where displays can be updated in place (asked once:
    a process does not move in or out of a kernel)."""
    if not _KERNEL:
        shell = get_ipython()
        _KERNEL.append(shell is not None and getattr(shell, "kernel", None) is not None)
    return _KERNEL[0]


class RankFiles:
    """The output files of the ranks, read as they grow."""

    def __init__(self):
        self._files: dict[int, list[list]] = {}  # rank -> [[stream, fd, offset], ...]

    def attach(self, rank: int, out_path: str, err_path: str) -> None:
        self.detach(rank)
        files = []
        for stream, path in (("stdout", out_path), ("stderr", err_path)):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            files.append([stream, fd, 0])
        self._files[rank] = files

    def detach(self, rank: int) -> None:
        for _, fd, _ in self._files.pop(rank, []):
            os.close(fd)

    def detach_all(self) -> None:
        for rank in list(self._files):
            self.detach(rank)

    def catch_up(self, replies: dict) -> None:
        """Nothing to catch up: the files are read here (ForwardedOutput has to)."""

    def settle(self, ranks, timeout: float) -> None:
        """Nothing to wait for: a file outlives its rank."""

    def ended(self) -> list[int]:
        return []  # local ranks: their exit codes say it

    def close(self) -> None:
        self.detach_all()

    def has(self, rank: int) -> bool:
        return bool(self._files.get(rank))

    def read(self) -> list[tuple[int, str, str]]:
        """(rank, stream, text) for everything written since the last read."""
        found = []
        for rank, files in self._files.items():
            for entry in files:
                stream, fd, offset = entry
                try:
                    size = os.fstat(fd).st_size
                    if size <= offset:
                        continue
                    data = os.pread(fd, size - offset, offset)
                except OSError:
                    continue
                entry[2] = offset + len(data)
                found.append((rank, stream, data.decode("utf-8", "replace")))
        return found

    def tail(self, rank: int, lines: int = 15) -> str:
        """The last lines the rank wrote (both streams), for a RankDied message; a crash
        report (faulthandler's "Fatal Python error") is shown from its start, after the last
        lines of the other stream (what the rank printed before it died)."""
        streams = []
        for _, fd, _ in self._files.get(rank, []):
            try:
                size = os.fstat(fd).st_size
                streams.append(os.pread(fd, min(size, 65536), max(0, size - 65536))
                               .decode("utf-8", "replace").splitlines())
            except OSError:
                continue
        for i, text in enumerate(streams):
            crash = next((j for j, x in enumerate(text) if x.startswith("Fatal Python")), None)
            if crash is not None:
                before = [x for k, other in enumerate(streams) if k != i for x in other]
                return "\n".join(before[-5:] + text[max(0, crash - 3):crash + lines])
        return "\n".join([x for text in streams for x in text][-lines:])


class _Progress:
    """One rank's carriage-return line, shown in place."""

    def __init__(self, live: bool):
        self.live, self.handle, self.text, self.shown_at = live, None, "", float("-inf")

    def show(self, label: str, text: str, now: float, final: bool = False) -> None:
        self.text = text
        if not self.live or (not final and now - self.shown_at < PROGRESS_EVERY_S):
            return
        data = {"text/plain": f"{label} {text}"}
        if self.handle is None:
            self.handle = IPython.display.display(data, raw=True, display_id=True)
        else:
            self.handle.update(data, raw=True)
        self.shown_at = now


def _handled(rank: int, line: str) -> bool:
    for marker, handler in list(LINE_HANDLERS.items()):
        if marker in line:
            try:
                handler(rank, line)
            except Exception as exc:  # a view's failure must never stop the cell's watch
                LINE_HANDLERS.pop(marker, None)
                print(f"[tplab] live view stopped: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
            return True
    return False


class _Stream:
    LOOK_AHEAD = 50  # lines of another rank looked at to tell whether it will print a line

    def __init__(self, file, live: bool):
        self.file, self.live = file, live
        self.partial: dict[int, str] = {}
        # rank -> lines waiting, oldest first, from index head[rank] on (a list and a start,
        # so that taking k lines off the front costs nothing)
        self.lines: dict[int, list[str]] = {}
        self.times: dict[int, list[float]] = {}
        self.head: dict[int, int] = {}
        self.progress: dict[int, _Progress] = {}
        self.grouped_with: dict[int, frozenset[int]] = {}  # rank -> its last line's ranks
        self.ever_with: dict[int, set[int]] = {}  # rank -> every rank it shared a line with
        self.shown: dict[int, int] = {}  # rank -> how many of its lines were shown
        self.lag = 0.0  # the largest lag seen between ranks printing the same line

    def _seen_lag(self, ranks) -> None:
        arrivals = [self.times[r][self.head[r]] for r in ranks]
        self.lag = max(self.lag, max(arrivals) - min(arrivals))

    def long_window(self) -> float:
        return min(MAX_WINDOW_S, max(ALIKE_WINDOW_S, LAG_FACTOR * self.lag))

    def _queue(self, rank: int, now: float, lines: list[str]) -> None:
        if rank not in self.lines:
            self.lines[rank], self.times[rank], self.head[rank] = [], [], 0
        self.lines[rank].extend(lines)
        self.times[rank].extend(itertools.repeat(now, len(lines)))

    def _waiting(self, rank: int) -> int:
        return len(self.lines[rank]) - self.head[rank] if rank in self.lines else 0

    def _grouped(self, rank: int, group: frozenset[int]) -> None:
        self.grouped_with[rank] = group
        if len(group) > 1:
            self.ever_with.setdefault(rank, set()).update(group - {rank})

    def _pop(self, rank: int, k: int = 1) -> None:
        self.shown[rank] = self.shown.get(rank, 0) + k
        head = self.head[rank] = self.head[rank] + k
        if head > 4096 and head * 2 > len(self.lines[rank]):  # drop what was shown
            del self.lines[rank][:head], self.times[rank][:head]
            self.head[rank] = 0

    def feed(self, rank: int, text: str, now: float) -> None:
        text = self.partial.pop(rank, "") + text
        *complete, rest = text.split("\n")
        if LINE_HANDLERS:
            complete = [line for line in complete if not _handled(rank, line)]
        if "\r" in text:
            plain = []
            for line in complete:
                if "\r" in line:
                    self._queue(rank, now, plain)
                    plain = []
                    self._progress(rank, line, now, final=True)
                else:
                    plain.append(line)
            complete = plain
        self._queue(rank, now, complete)
        if rest:
            self.partial[rank] = rest
            if "\r" in rest:
                self._progress(rank, rest, now)

    def _progress(self, rank: int, line: str, now: float, final: bool = False) -> None:
        parts = [p for p in line.split("\r") if p.strip()]
        text = parts[-1] if parts else ""
        bar = self.progress.get(rank)
        if bar is None:
            bar = self.progress[rank] = _Progress(self.live)
        bar.show(f"[rank {rank}]", text, now, final)
        if final:
            del self.progress[rank]
            if not self.live:  # no display to update: the bar's last state, as a line
                self._queue(rank, now, [text])

    def _alike(self, participants: set[int]) -> list[str]:
        """The fast path: the lines every participant has printed alike, all at once."""
        ranks = sorted(participants)
        if len(ranks) < 2 or any(not self._waiting(r) for r in ranks):
            return []
        k = min(self._waiting(r) for r in ranks)
        texts = [self.lines[r][self.head[r]:self.head[r] + k] for r in ranks]
        while k and any(t[:k] != texts[0][:k] for t in texts[1:]):
            k //= 2  # a common prefix of k lines (list compares run in C)
        if not k:
            return []
        alike = texts[0][:k]
        self._seen_lag(ranks)
        group = frozenset(participants)
        for r in ranks:
            self._pop(r, len(alike))
            self._grouped(r, group)
        label = f"[{format_rank_list(participants)}] "
        return [label + line for line in alike]

    def _later(self, rank: int, line: str) -> bool:
        """Whether `rank` has `line` waiting behind its first line."""
        head = self.head[rank]
        return line in self.lines[rank][head + 1:head + self.LOOK_AHEAD]

    def flush(self, participants: set[int], now: float, final: bool) -> None:
        if final:
            for rank, rest in list(self.partial.items()):
                if "\r" in rest:
                    self._progress(rank, rest, now, final=True)
                else:
                    self._queue(rank, now, [rest])
            self.partial.clear()
        out = self._alike(participants)
        while True:
            heads = {r: (self.times[r][self.head[r]], q[self.head[r]])
                     for r, q in self.lines.items() if len(q) > self.head[r]}
            if not heads:
                break
            # A line some rank has further back in its queue waits for that rank's earlier
            # lines: so "[ranks 0-3] loss" stays one line when rank 1 printed more first.
            ready = [r for r, (_, line) in heads.items()
                     if not any(self._later(q, line) for q in heads if q != r)]
            first = min(ready or heads, key=lambda r: (heads[r][0], r))  # arrival, then rank
            arrived, line = heads[first]
            same = [r for r, (_, text) in heads.items() if text == line]
            silent = [r for r in participants if r not in heads]
            place = self.shown.get(first, 0)  # the line's place in its rank's output
            # ranks that have not got to this place yet (silent, or with fewer lines queued)
            behind = [s for s in participants if s not in same and
                      self.shown.get(s, 0) + self._waiting(s) <= place]
            # one that printed lines alike with this rank prints the same lines, only later
            # (load): it gets the longest wait, not one learnt from earlier lags
            following = any(s in self.ever_with.get(first, ()) for s in behind)
            lagging = behind or any(s in self.grouped_with.get(same[0], ()) for s in silent)
            window = MAX_WINDOW_S if following else self.long_window() if lagging \
                else WINDOW_S
            if final or not (silent or behind) or now - arrived >= window:
                if len(same) > 1:
                    self._seen_lag(same)
                out.append(f"[{format_rank_list(same)}] {line}")
                group = frozenset(same)
                for r in same:
                    self._pop(r)
                    self._grouped(r, group)
            else:
                break
        if out:
            self.file.write("\n".join(out) + "\n")
            self.file.flush()


class LiveOutput:
    """Shows the ranks' output of one cell as it arrives (see the module docstring)."""

    def __init__(self, participants, stdout=None, stderr=None, live: bool | None = None):
        live = in_kernel() if live is None else live
        self.participants = set(participants)
        self._streams = {"stdout": _Stream(stdout or sys.stdout, live),
                         "stderr": _Stream(stderr or sys.stderr, live)}

    def feed(self, chunks: list[tuple[int, str, str]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rank, stream, text in chunks:
            self.participants.add(rank)
            self._streams[stream].feed(rank, text, now)

    def flush(self, now: float | None = None, final: bool = False) -> None:
        now = time.monotonic() if now is None else now
        for stream in self._streams.values():
            stream.flush(self.participants, now, final)


class StatusLine:
    """One line, updated in place, that says what the lab is waiting for."""

    def __init__(self, live: bool | None = None):
        self.live = in_kernel() if live is None else live
        self.handle = None
        self.text = ""
        self.printed_at = 0.0

    def show(self, text: str) -> None:
        if text == self.text:
            return
        self.text = text
        if self.live:
            data = {"text/plain": f"[tplab] {text}"}
            if self.handle is None:
                self.handle = IPython.display.display(data, raw=True, display_id=True)
            else:
                self.handle.update(data, raw=True)
        elif time.monotonic() - self.printed_at > 5.0:
            print(f"[tplab] {text}", file=sys.stderr, flush=True)
            self.printed_at = time.monotonic()

    def clear(self) -> None:
        if self.handle is not None and self.text:
            self.handle.update({"text/plain": ""}, raw=True)
        self.text = ""
