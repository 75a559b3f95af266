"""Turning the ranks' reports of where they are into a table and a one-line diagnosis."""

from __future__ import annotations

from tplab.lab.output import format_rank_list


def _collective(w: dict) -> str:
    if w.get("state") != "in_collective":
        return ""
    shape = w.get("shape")
    return f"{w['op']} #{w.get('seq', '?')}" + (f" of shape {shape}" if shape else "")


def _state(r: int, w: dict | None, cell: int, finished: list[int]) -> str:
    if r in finished:
        return "finished"
    if w is None or w.get("cell") != cell:
        return "no report"
    return {"in_collective": "waiting", "running": "computing"}.get(w["state"], w["state"])


def hang_report(where: dict[int, dict], cell: int, finished: list[int], ranks: list[int],
                timeout: float) -> str:
    """A per-rank table and a diagnosis for a cell that ran past `timeout`."""
    rows = [("rank", "state", "collective", "collectives issued", "line")]
    for r in ranks:
        w = where.get(r) or {}
        state = _state(r, where.get(r), cell, finished)
        done = w.get("collectives", "") if w.get("cell") == cell else ""
        rows.append((str(r), state, _collective(w) if state == "waiting" else "",
                     str(done), (w.get("line") or "") if state != "finished" else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
                      + "  " + row[4] for row in rows)
    return (f"the cell did not finish within {timeout:g} s.\n"
            f"{diagnosis(where, cell, finished, ranks)}\n{table}")


def diagnosis(where: dict[int, dict], cell: int, finished: list[int], ranks: list[int]) -> str:
    states = {r: _state(r, where.get(r), cell, finished) for r in ranks}
    waiting = {r: where[r] for r, s in states.items() if s == "waiting"}
    computing = [r for r, s in states.items() if s == "computing"]
    done = [r for r, s in states.items() if s == "finished"]
    silent = [r for r, s in states.items() if s == "no report"]
    kinds: dict[tuple, list[int]] = {}
    for r, w in waiting.items():
        kinds.setdefault((w["op"], tuple(w.get("shape") or ()), w.get("seq")), []).append(r)
    if len(kinds) > 1:
        parts = [f"{format_rank_list(rs)} {'is' if len(rs) == 1 else 'are'} in "
                 f"{_collective(waiting[rs[0]])}" for rs in kinds.values()]
        return "Mismatched collectives: " + "; ".join(parts) + "."
    if waiting:
        rs = list(waiting)
        head = (f"{format_rank_list(rs)} {'is' if len(rs) == 1 else 'are'} in "
                f"{_collective(waiting[rs[0]])}")
        if done:
            return f"{head}; {format_rank_list(done)} finished the cell without calling it."
        if computing:
            line = where[computing[0]].get("line") or "?"
            return (f"{head}, waiting for {format_rank_list(computing)}, still computing "
                    f"at {line}.")
        if silent:
            return f"{head}; {format_rank_list(silent)} sent no report (stuck outside Python?)."
        return f"{head}: every rank is in the same collective, yet it does not complete."
    if computing:
        return (f"No rank is in a collective: {format_rank_list(computing)} still computing. "
                "If the cell is just slow, give it more time: lab.run(..., timeout=SECONDS) "
                "or tplab.launch(..., timeout=SECONDS).")
    return "No rank reported where it is."


def stuck_note(stuck: list[int], where: dict[int, dict], cell: int, restart_s: float) -> str:
    """What to say about ranks left waiting after other ranks raised."""
    parts = []
    for r in stuck:
        w = where.get(r) or {}
        what = _collective(w) if w.get("cell") == cell and w.get("state") == "in_collective" \
            else "the cell"
        parts.append(f"rank {r} was waiting in {what}")
    return (f"{'; '.join(parts)} for the ranks that failed; the lab restarted its ranks in "
            f"{restart_s:.1f} s and is ready again (names defined on the ranks are gone).")
