"""Reading the ranks' reports of where they are: who waits for whom, and in words.

A report (tplab/rank/whereabouts.py `where_now`) says whether a rank computes or waits in a
collective, and how many collectives it has issued on each of its groups. From these:
- `owed`: collectives that a rank waits in and a peer will never call, because the peer
  finished the cell (or was not asked to run it) with fewer collectives on that group;
- `deadlocked`: every unfinished rank waits and none of their collectives can complete
  (a peer lags on that group while itself blocked elsewhere, or ops differ);
- `table` and `diagnosis`: what to print.
"""

from __future__ import annotations

from dataclasses import dataclass

from tplab.errors import format_rank_list

STALE_S = 1.0  # a report older than this says nothing about the rank now


@dataclass
class RankView:
    rank: int
    state: str  # finished, not asked, computing, waiting, no report
    report: dict

    def seq(self, group: str) -> int | None:
        g = (self.report.get("groups") or {}).get(group)
        return g["seq"] if g else None


def views(where: dict[int, dict], cell: int, targets: list[int], done: list[int],
          world_size: int, now: float) -> dict[int, RankView]:
    out = {}
    for r in range(world_size):
        w = where.get(r) or {}
        if r not in targets:
            state = "not asked"
        elif r in done:
            state = "finished"
        elif w.get("cell") != cell or now - w.get("time", 0) > STALE_S \
                or w.get("state") == "finished":
            state = "no report"
        else:
            state = "waiting" if w.get("state") == "in_collective" else "computing"
        out[r] = RankView(r, state, w)
    return out


def blocked_on(view: RankView) -> tuple[str, int, dict] | None:
    """(group, seq, call) of the collective a waiting rank most likely waits in: its
    latest noted call (c10d calls block in place; a funcol wait is for the latest)."""
    best = None
    for group, calls in (view.report.get("history") or {}).items():
        for call in calls:
            if call.get("seq") is None:
                continue
            if best is None or call.get("order", 0) >= best[2].get("order", 0):
                best = (group, call["seq"], call)
    return best


def owed(views_: dict[int, RankView]) -> dict[tuple[int, str], tuple[int, int]]:
    """(idle rank, group) -> (its seq, the seq a waiting member reached): collectives a
    waiting rank issued on a group that an idle member (finished, or not asked) lacks.
    A finished member whose report still says it runs has not had its final report read:
    its counts are not final, so nothing is owed by it yet."""
    found: dict[tuple[int, str], tuple[int, int]] = {}
    for w in views_.values():
        if w.state != "waiting":
            continue
        for group, info in (w.report.get("groups") or {}).items():
            for p in info.get("ranks", []):
                peer = views_.get(p)
                if peer is None or peer.state not in ("finished", "not asked"):
                    continue
                if peer.state == "finished" and peer.report.get("state", "finished") \
                        != "finished":
                    continue
                have = peer.seq(group)
                if have is not None and have < info["seq"]:
                    old = found.get((p, group), (have, have))
                    found[(p, group)] = (have, max(old[1], info["seq"]))
    return found


def deadlocked(views_: dict[int, RankView]) -> bool:
    """Every unfinished rank waits, and no waited-in collective can complete."""
    unfinished = [v for v in views_.values() if v.state in ("waiting", "computing", "no report")]
    if not unfinished or any(v.state != "waiting" for v in unfinished):
        return False
    blocked = {v.rank: blocked_on(v) for v in unfinished}
    if any(b is None for b in blocked.values()):
        return False  # cannot tell what some rank waits in
    seen: dict[tuple[str, int], str] = {}
    for group, seq, call in blocked.values():
        family = call.get("op", call.get("api"))
        if seen.setdefault((group, seq), family) != family:
            return True  # the same collective number, different ops
    for r, (group, seq, _) in blocked.items():
        members = ((views_[r].report.get("groups") or {}).get(group) or {}).get("ranks", [])
        lagging = [m for m in members if m in views_ and (views_[m].seq(group) or 0) < seq]
        if not lagging:
            return False  # every member issued it: it can complete
        if any(views_[m].state in ("finished", "not asked") for m in lagging):
            return False  # an idle peer owes it: `owed` frees it
    return True


def group_words(report: dict, group: str, world_size: int) -> str:
    info = (report.get("groups") or {}).get(group) or {}
    ranks = info.get("ranks") or []
    desc = info.get("desc") or ""
    if len(ranks) == world_size:
        return "the world group"
    name = f"mesh dim '{desc.removeprefix('mesh_')}', " if desc.startswith("mesh_") else ""
    return f"the group of {name}{format_rank_list(ranks)}"


def collective_words(view: RankView, world_size: int) -> str:
    w = view.report
    blocked = blocked_on(view)
    op = w.get("op") or "a collective"
    if op == "wait_tensor" and blocked is not None:
        op = blocked[2].get("op", op)
    shape = w.get("shape")
    text = op
    if blocked is not None:
        text += f" #{blocked[1]} on {group_words(w, blocked[0], world_size)}"
    return text + (f" of shape {shape}" if shape else "")


def table(views_: dict[int, RankView], world_size: int) -> str:
    rows = [("rank", "state", "collective", "line")]
    for r, v in views_.items():
        what = collective_words(v, world_size) if v.state == "waiting" else ""
        line = (v.report.get("line") or "") if v.state in ("waiting", "computing") else ""
        rows.append((str(r), v.state, what, line))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True))
                     + "  " + row[3] for row in rows)


def _are(ranks) -> str:
    return f"{format_rank_list(ranks)} {'is' if len(ranks) == 1 else 'are'}"


def owed_words(views_: dict[int, RankView], debts, world_size: int) -> str:
    waiting = [r for r, v in views_.items() if v.state == "waiting"]
    finished = sorted({p for p, _ in debts if views_[p].state == "finished"})
    not_asked = sorted({p for p, _ in debts if views_[p].state == "not asked"})
    parts = []
    if finished:
        parts.append(f"{format_rank_list(finished)} finished the cell without calling it")
    if not_asked:
        parts.append(f"{format_rank_list(not_asked)} {'was' if len(not_asked) == 1 else 'were'}"
                     " not asked to run this cell (ranks=...)")
    head = f"{_are(waiting)} in {collective_words(views_[waiting[0]], world_size)}"
    return f"{head}; {' and '.join(parts)}."


def diagnosis(views_: dict[int, RankView], world_size: int) -> str:
    debts = owed(views_)
    if debts:
        return owed_words(views_, debts, world_size)
    waiting = {r: v for r, v in views_.items() if v.state == "waiting"}
    computing = [r for r, v in views_.items() if v.state == "computing"]
    silent = [r for r, v in views_.items() if v.state == "no report"]
    kinds: dict[str, list[int]] = {}
    for r, v in waiting.items():
        kinds.setdefault(collective_words(v, world_size), []).append(r)
    if len(kinds) > 1:
        return "Mismatched collectives: " + "; ".join(
            f"{_are(rs)} in {text}" for text, rs in kinds.items()) + "."
    if waiting:
        rs = list(waiting)
        head = f"{_are(rs)} in {collective_words(waiting[rs[0]], world_size)}"
        if computing:
            line = views_[computing[0]].report.get("line") or "?"
            return f"{head}, waiting for {format_rank_list(computing)}, computing at {line}."
        if silent:
            return (f"{head}; {format_rank_list(silent)} sent no report (busy in C code "
                    "that holds the GIL?).")
        return f"{head}: every rank is in the same collective, yet it does not complete."
    if computing:
        return f"No rank waits in a collective: {format_rank_list(computing)} computing."
    return "No rank reported where it is."


def waiting_status(views_: dict[int, RankView], world_size: int, seconds: float) -> str | None:
    """The live status line while ranks wait for peers that compute, or None."""
    waiting = [r for r, v in views_.items() if v.state == "waiting"]
    computing = [r for r, v in views_.items() if v.state == "computing"]
    if not waiting or not computing:
        return None
    line = views_[computing[0]].report.get("line") or "?"
    return (f"{_are(waiting)} waiting in {collective_words(views_[waiting[0]], world_size)} "
            f"for {format_rank_list(computing)}, computing at {line} ({seconds:.0f} s)")
