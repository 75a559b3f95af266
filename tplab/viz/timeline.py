"""`comm_timeline`: one lane per rank, a box per collective, forward and backward in two colours.

Drawn from `tplab.trace` records (docs/CONTRACTS.md) brought back from the ranks. Lanes that
do not match show a bug at a glance: a rank with one collective fewer is a rank that the
others will wait for forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import plotly.graph_objects as go

from tplab.viz.palette import (
    PHASE_COLORS,
    group_look,
    group_order,
    human_bytes,
    op_label,
    op_words,
    rank_color,
    style,
)

PHASES = ("forward", "backward")


def flatten(trace) -> list[dict]:
    """Records from a flat list, a list of per-rank lists, or anything with `.records`."""
    if hasattr(trace, "records"):
        trace = trace.records
    out: list[dict] = []
    for item in trace or []:
        if isinstance(item, Mapping):
            out.append(dict(item))
        elif isinstance(item, Iterable):
            out.extend(flatten(item))
        else:
            raise TypeError(f"expected trace records (dicts), got {type(item).__name__}")
    return out


def _hover_row(rec: dict) -> list[str]:
    shape = "×".join(str(s) for s in rec.get("shape") or []) or "scalar"
    group = str(rec.get("group", ""))
    if rec.get("group_size"):
        group += f" ({rec['group_size']} ranks)"
    dur = rec.get("duration_ms")
    module = rec.get("module") or "(whole model)"
    return [op_words(rec.get("op", "?")), rec.get("phase", "?"), module,
            f"{shape} {rec.get('dtype', '')}".strip(), human_bytes(rec.get("bytes", 0) or 0),
            group, f"{dur:.3f} ms" if isinstance(dur, int | float) else "not measured"]


HOVER = ("<b>%{customdata[0]}</b> (%{customdata[1]})<br>module: %{customdata[2]}"
         "<br>shape: %{customdata[3]}<br>bytes: %{customdata[4]}<br>group: %{customdata[5]}"
         "<br>time: %{customdata[6]}<extra>%{y}</extra>")


def _box_text(rec: dict, wide: bool, group: bool = False) -> str:
    """The op (and the group, where a trace has several), then the module if there is room."""
    on = f" · {rec.get('group', '?')}" if group else ""
    if not wide:
        return op_label(rec.get("op", "?")) + on.replace(" ", "")
    # "" is the model itself: a hook on the root module, such as Megatron's f on the input.
    module = ".".join((rec.get("module") or "").split(".")[-2:]) or "(whole model)"
    return f"{op_words(rec.get('op', '?'))}{on}<br>{module}"


def _phase_runs(recs: list[dict], starts: list[float], ends: list[float]) -> list[tuple]:
    """[(start, end, phase)] for consecutive records of one phase on one rank."""
    runs: list[list] = []
    for rec, s, e in zip(recs, starts, ends, strict=True):
        if runs and runs[-1][2] == rec.get("phase"):
            runs[-1][1] = e
        else:
            runs.append([s, e, rec.get("phase")])
    return [tuple(r) for r in runs]


def comm_timeline(trace, *, x: str = "seq", title: str | None = None) -> go.Figure:
    """Per-rank lanes of the collectives in a trace, coloured by phase.

    `trace`: a list of per-rank record lists, or a flat list of records. `x="seq"` puts
    the n-th collective of every rank in column n; `x="time"` lays boxes end to end by
    `duration_ms` (time spent between collectives is not recorded, so it is not shown).
    One bar trace per phase; its `meta` lists the (rank, seq, op, module, group) of each
    box. A trace on several groups (tp and dp of a 2-D mesh) gets one bar trace per phase
    and group, named "backward · dp", each box labelled with its group and each group
    filled with its own pattern (`palette.group_look`: tp plain, dp hatched).
    """
    if x not in ("seq", "time"):
        raise ValueError(f"x must be 'seq' or 'time', not {x!r}")
    recs = flatten(trace)
    by_rank: dict[int, list[dict]] = {}
    for rec in sorted(recs, key=lambda r: (r.get("rank", 0), r.get("seq", 0))):
        by_rank.setdefault(int(rec.get("rank", 0)), []).append(rec)
    fig = go.Figure()
    lanes = [f"rank {r}" for r in sorted(by_rank)]
    pos = _positions(by_rank, x)
    columns = max((len(rl) for rl in by_rank.values()), default=0)
    wide = x == "seq" and columns <= 8  # room for the op's name and module in each box
    groups = group_order(str(rec.get("group", "")) for rec in recs)
    phases = (*PHASES, *sorted({rec.get("phase") for rec in recs} - set(PHASES)))
    for phase, group in ((p, g) for p in phases for g in (groups if len(groups) > 1 else [None])):
        _add_bars(fig, by_rank, pos, phase, group, groups, wide)
    if not recs:
        fig.add_annotation(text="No collectives were recorded in this trace.", showarrow=False,
                           x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 16})
    if x == "seq":
        _shade_phases(fig, by_rank, pos)
    # A square in the rank's own colour at the head of each lane, as in the other figures.
    left = -0.8 if x == "seq" else -0.03 * max((sum(w) for _, w in pos.values()), default=1)
    fig.add_trace(go.Scatter(
        x=[left] * len(lanes), y=lanes, mode="markers", showlegend=False, hoverinfo="skip",
        marker={"symbol": "square", "size": 16, "color": [rank_color(r) for r in by_rank]}))
    sub = _subtitle(recs, by_rank, groups, wide)
    fig.update_xaxes(tickvals=list(range(columns)) if x == "seq" else None)
    extra = 22 * max(0, sub.count("<br>") - 1)  # room for a subtitle of three lines or more
    style(fig, title or "Collectives on each rank, in the order issued", sub,
          barmode="overlay", height=max(320, 140 + 70 * len(lanes)) + extra, width=1100,
          legend={"title": {"text": "phase · group" if len(groups) > 1 else "phase"}},
          margin={"t": 130 + extra, "l": 80, "r": 40, "b": 60},
          bargap=0.35)
    fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1], title_text="")
    fig.update_xaxes(
        title_text=("n-th collective on the rank" if x == "seq"
                    else "time inside collectives, end to end (ms)"),
        dtick=1 if x == "seq" else None, zeroline=False, tick0=0,
        range=[left - 0.25 if x == "seq" else 1.4 * left, (columns - 0.5) if x == "seq"
               else -0.2 * left + max((sum(w) for _, w in pos.values()), default=1)])
    return fig


def _positions(by_rank: dict[int, list[dict]], x: str) -> dict[int, tuple[list, list]]:
    """{rank: (box starts, box widths)}: column n for the n-th collective (`x="seq"`), or
    end to end by duration (`x="time"`)."""
    pos: dict[int, tuple[list[float], list[float]]] = {}
    for r, rl in by_rank.items():
        if x == "seq":
            starts = [i - 0.45 for i in range(len(rl))]  # box n centred on n
            widths = [0.9] * len(rl)
        else:
            widths = [max(float(rec.get("duration_ms") or 0.0), 1e-3) for rec in rl]
            starts = [sum(widths[:i]) for i in range(len(rl))]
        pos[r] = (starts, widths)
    return pos


def _add_bars(fig, by_rank, pos, phase, group, groups: list[str], wide: bool) -> None:
    """One bar trace: the boxes of one phase (and one group, when there are several)."""
    several = group is not None
    ys, xs, bases, text, custom, meta = [], [], [], [], [], []
    for r, rl in by_rank.items():
        for rec, s, w in zip(rl, *pos[r], strict=True):
            if rec.get("phase") != phase or group not in (None, str(rec.get("group", ""))):
                continue
            ys.append(f"rank {r}")
            bases.append(s)
            xs.append(w)
            text.append(_box_text(rec, wide, several))
            custom.append(_hover_row(rec))
            meta.append({"rank": r, "seq": rec.get("seq"), "op": rec.get("op"),
                         "module": rec.get("module"), "group": rec.get("group")})
    if not ys:
        return
    pattern = group_look(group, groups)[0] if several else ""
    fig.add_trace(go.Bar(
        orientation="h", y=ys, x=xs, base=bases, text=text,
        name=phase if group is None else f"{phase} · {group}", legendgroup=phase,
        textposition="inside", insidetextanchor="middle", textangle=0,
        textfont={"color": "white", "size": 13}, customdata=custom, hovertemplate=HOVER,
        marker={"color": PHASE_COLORS.get(phase, "#757575"),
                "line": {"color": "white", "width": 1},
                "pattern": {"shape": pattern, "fgcolor": "rgba(255, 255, 255, 0.45)",
                            "size": 9, "solidity": 0.2}},
        meta=meta))


def _shade_phases(fig, by_rank, pos) -> None:
    """Shade the forward and backward stretches when every rank agrees on where they are."""
    runs = {r: _phase_runs(rl, pos[r][0], [s + w for s, w in zip(*pos[r], strict=True)])
            for r, rl in by_rank.items()}
    same = len({tuple((round(a, 6), p) for a, _, p in rs) for rs in runs.values()}) == 1
    if not (runs and same):
        return
    for start, end, phase in next(iter(runs.values())):
        fig.add_vrect(x0=start - 0.05, x1=end + 0.05, fillcolor=PHASE_COLORS.get(phase),
                      opacity=0.07, line_width=0)
        fig.add_annotation(x=start, y=1.0, xref="x", yref="paper", yanchor="bottom",
                           xanchor="left", showarrow=False, text=f"<b>{phase}</b>",
                           font={"color": PHASE_COLORS.get(phase), "size": 13})


def _subtitle(recs, by_rank, groups: list[str], wide: bool) -> str:
    """Counts per phase, ranks that disagree, the groups' fills, and the ops' short names."""
    n = {p: sum(1 for rec in recs if rec.get("phase") == p) for p in PHASES}
    sub = (f"{len(recs)} collectives on {len(by_rank)} ranks: {n['forward']} forward, "
           f"{n['backward']} backward · hover a box for op, shape, bytes and module")
    counts = {r: len(rl) for r, rl in by_rank.items()}
    if len(set(counts.values())) > 1:
        most = max(set(counts.values()), key=list(counts.values()).count)
        odd = ", ".join(f"rank {r}: {c}" for r, c in counts.items() if c != most)
        sub += (f"<br><span style='color:#c62828'>ranks disagree: {odd}, the others {most}. "
                "A collective that some ranks skip makes the others wait forever.</span>")
    if len(groups) > 1:
        fills = {g: group_look(g, groups)[0] for g in groups}
        looks = ", ".join(f"{g} {'hatched' if fills[g] else 'plain'}" for g in groups)
        sub += f"<br>collectives on {len(groups)} groups, each box labelled with its own: {looks}"
    if not wide and recs:
        ops = sorted({rec.get("op", "?") for rec in recs})
        sub += "<br>" + ", ".join(f"{op_label(o)} = {op_words(o)}" for o in ops)
    return sub
