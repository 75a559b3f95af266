"""Grouping per-rank output: a line printed by every rank is shown once as [ranks 0-3].
Imports nothing: both sides use it (tplab/rank/runner.py strips colours from tracebacks
too)."""

from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes (IPython's tracebacks)


def strip_ansi(text: str) -> str:
    """text without terminal colour codes."""
    return ANSI.sub("", text)


def format_rank_list(ranks) -> str:
    """[0, 1, 2, 3] -> "ranks 0-3"; [0, 2] -> "ranks 0,2"; [1] -> "rank 1"."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}-{prev}" if prev - start >= 2 else
                     ",".join(str(x) for x in range(start, prev + 1)))
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(spans)


def print_grouped(texts: dict[int, str], file) -> None:
    """Print each rank's output, a line at a time, labelled by rank.

    Line i of every rank is compared across ranks: ranks that printed the same line i are
    shown once as "[ranks 0-3] line", so a loss printed by every rank appears once.
    """
    per_rank = {r: t.splitlines() for r, t in texts.items() if t}
    if not per_rank:
        return
    out = []
    for i in range(max(len(lines) for lines in per_rank.values())):
        groups: dict[str, list[int]] = {}
        for r, lines in per_rank.items():
            if i < len(lines):
                groups.setdefault(lines[i], []).append(r)
        for line, ranks in groups.items():
            out.append(f"[{format_rank_list(ranks)}] {line}")
    print("\n".join(out), file=file, flush=True)
