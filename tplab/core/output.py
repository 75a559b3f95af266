"""Grouping per-rank output: a line printed by every rank is shown once as [ranks 0-3].
Imports only tplab.errors (format_rank_list, how tplab names ranks): both sides use it
(tplab/rank/runner.py strips colours from tracebacks too)."""

from __future__ import annotations

import re

from tplab.errors import format_rank_list

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes (IPython's tracebacks)


def strip_ansi(text: str) -> str:
    """text without terminal colour codes."""
    return ANSI.sub("", text)


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
