"""Freeing a rank stuck in a collective that a finished peer never called, without a restart.

A rank that waits in collective number k of a group, while a peer finished the cell after
k-1 calls on it, will wait forever. Its report (tplab/rank/collectives.py) holds the calls
it made, described (shapes, dtypes, ops); the watchdog has the peer replay the missing ones
with placeholder zeros (`collectives.complete_pending`), so the stuck rank is freed and the
names on every rank survive. Only calls whose every argument a placeholder can stand for
are replayed; otherwise the lab restarts (tplab/lab/watchdog.py).
"""

from __future__ import annotations

from tplab.errors import format_rank_list


def replays(views, debts) -> dict | None:
    """(peer, group) -> the calls the peer must make, from a waiting rank's history."""
    calls = {}
    for (peer, group), (have, reached) in debts.items():
        rows = {}
        for v in views.values():
            if v.state == "waiting":
                for call in (v.report.get("history") or {}).get(group, []):
                    if call.get("seq") is not None and have < call["seq"] <= reached:
                        rows[call["seq"]] = dict(call, group=group)
        if sorted(rows) != list(range(have + 1, reached + 1)) or any(
                unknown_argument(row) for row in rows.values()):
            return None
        calls[(peer, group)] = list(rows.values())
    return calls


def unknown_argument(call: dict) -> bool:
    """True when a call has an argument (other than its group) no placeholder can stand
    for: a peer could not make the same call."""
    pos = call.get("group_pos")
    values = [a for i, a in enumerate(call["args"]) if i != pos]
    values += [v for k, v in call["kwargs"].items() if k != "group"]
    return any(isinstance(v, list) and v[:1] == ["?"] for v in values)


def freed_note(freed: list[list[int]]) -> str:
    """What a cell's report says when peers replayed collectives (`freed`: the peers of
    each round)."""
    if not freed:
        return ""
    peers = sorted({p for round_ in freed for p in round_})
    n = len(freed)
    return (f"The lab freed the waiting ranks by completing {n} collective"
            f"{'s' if n != 1 else ''} on {format_rank_list(peers)} with placeholder data "
            "(zeros), so this cell's results are not valid. No restart was needed: names "
            "defined on the ranks are kept.")
