"""`grad_flow`: the model's modules in a row, forward above, backward below, collectives on edges.

This is the picture of Megatron-LM's f and g (Shoeybi et al. 2019, fig. 3) drawn from a
real trace rather than by hand. Which edge a collective sits on is decided in
`tplab.viz.edges` (reductions after the compute that made the partial sums, gathers before
the compute that needs the whole). Modules that read the same input (attention's wq, wk, wv;
SwiGLU's w1 and w3) are drawn as parallel branches, stacked in one column: one shared edge
feeds them and each has its own edge besides, so DTensor's f on every branch and
Megatron's single f on the shared input read apart.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import plotly.graph_objects as go

from tplab.explain import conjugate, short_cause
from tplab.viz.edges import (  # noqa: F401  (module_order, side: part of this module's API)
    match,
    module_order,
    role,
    side,
    side_in_context,
    split_modules,
    stages_from_trace,
)
from tplab.viz.palette import NODE_COLOR, PHASE_COLORS, human_bytes, op_symbol, op_words, style
from tplab.viz.timeline import flatten

ROW_Y = 0.8  # height of the forward row above a module (the backward row is at -ROW_Y)
STACK = 0.42  # spacing of several collectives on one edge
BOX = (0.36, 0.3)  # half width, half height of a module's box
GAP = 0.8  # room between one branch's backward row and the next one's forward row


def _display(names: list[str]) -> tuple[list[str], str]:
    """Strip the dotted prefix all modules share; break long names at dots."""
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    prefix = prefix[: prefix.rfind(".") + 1] if "." in prefix else ""
    out = []
    for n in names:
        short = n[len(prefix):] or n
        out.append(re.sub(r"([._])", r"\1<br>", short) if len(short) > 9 else short)
    return out, prefix


def _spot(where: list[int], sd: str, stages: list[list[int]], col_of: dict) -> tuple:
    """(edge, lane, branch module index) of a collective. Edge k joins column k and k+1
    (column 0 is the input, each stage of siblings one column); lane None is the shared
    part of the edge, ("in", b) / ("out", b) branch b of the stage it enters / leaves."""
    cols = sorted({col_of[i][0] for i in where})
    col = cols[0] if sd == "input" else cols[-1]
    edge = col - 1 if sd == "input" else col
    if len(where) == 1 and len(stages[col - 1]) > 1:
        return edge, ("in" if sd == "input" else "out", col_of[where[0]][1]), where[0]
    return edge, None, None


def _arrow(fig, x0, y0, x1, y1, color, head: bool) -> None:
    """A segment of an edge: an arrow (head at x1, y1) or a plain line."""
    if head:
        fig.add_annotation(x=x1, y=y1, ax=x0, ay=y0, xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=2, arrowsize=1.2, arrowwidth=2,
                           arrowcolor=color, opacity=0.55, text="")
    else:
        fig.add_shape(type="line", x0=x0, y0=y0, x1=x1, y1=y1, layer="below", opacity=0.55,
                      line={"color": color, "width": 2})


def _curve(fig, x0, y0, x1, y1, color) -> None:
    xm = (x0 + x1) / 2
    fig.add_shape(type="path", path=f"M {x0},{y0} C {xm},{y0} {xm},{y1} {x1},{y1}",
                  layer="below", opacity=0.55, line={"color": color, "width": 2})


def _edges(fig, offsets: list[list[float]]) -> None:
    """Forward arrows above, backward below; an edge fans out into the branches of the
    column it enters and gathers those of the column it leaves."""
    for e in range(len(offsets) - 1):
        src, dst = offsets[e], offsets[e + 1]
        fan_src, fan_dst = len(src) > 1, len(dst) > 1
        a = e + (0.40 if fan_src else 0.14)  # where the shared part starts and ends
        b = e + (0.60 if fan_dst else 0.86)
        if fan_src and fan_dst:
            a = b = e + 0.5
        elif fan_src:
            a = e + 0.60
        elif fan_dst:
            b = e + 0.40
        for sign, phase in ((1, "forward"), (-1, "backward")):
            color, row, fwd = PHASE_COLORS[phase], sign * ROW_Y, phase == "forward"
            if a < b:  # the shared part; its head where the edge ends unfanned
                tail, tip = (a, b) if fwd else (b, a)
                _arrow(fig, tail, row, tip, row, color, head=(not fan_dst) if fwd else
                       not fan_src)
            for c in src if fan_src else ():
                x = e + 0.40
                _curve(fig, x, c + row, a, row, color)
                _arrow(fig, *((e + 0.08, c + row, x, c + row) if fwd else
                              (x, c + row, e + 0.08, c + row)), color, head=not fwd)
            for c in dst if fan_dst else ():
                x = e + 0.60
                _curve(fig, b, row, x, c + row, color)
                _arrow(fig, *((x, c + row, e + 0.92, c + row) if fwd else
                              (e + 0.92, c + row, x, c + row)), color, head=fwd)


def grad_flow(trace, modules: Sequence | None = None, *, rank: int | None = None,
              title: str | None = None) -> go.Figure:
    """Draw where each collective of one rank's trace happens on the model's data flow.

    `trace`: records of one rank (or of several: `rank` picks one, default the lowest).
    `modules`: the model's modules in forward order; with it, modules with no collective
    are drawn too. An item that is a tuple of names is a group of siblings (modules that
    read the same input), as `tplab.viz.forward_stages(model, x)` returns them. With plain
    names, or none, siblings come from the trace (`tplab.viz.edges.stages_from_trace`).
    Marker traces' `meta` holds one dict per marker: module, edge (edge k joins column k
    and k+1; column 0 is the input, a group of siblings is one column), branch (the
    branch's module when the collective sits on that branch's own edge, else None), side,
    phase, op, group, count, role, cause (the record's `cause`: why it ran). Labels show
    a DTensor redistribution's placements in short ("P(sum)→R") and tplab.megatron's
    operator names; the hover text the whole cause and the conjugate collective.
    """
    pick, recs = _one_rank(trace, rank)
    names, stages, sides = _place(recs, modules)
    col_of = {i: (s + 1, b) for s, st in enumerate(stages) for b, i in enumerate(st)}
    groups, branch_of = _group(sides, stages, col_of)
    stacked: dict[tuple, int] = {}
    for phase, edge, lane, *_ in groups:
        stacked[(phase, edge, lane)] = stacked.get((phase, edge, lane), 0) + 1
    deepest = max(stacked.values(), default=1)
    lane_depth = max((n for k, n in stacked.items() if k[2] is not None), default=1)
    # labels of two lines (a redistribution's placements under the op) need more room
    stack = STACK * (1.7 if any(short_cause(r.get("cause") or "") for r in recs) else 1)
    pitch = 2 * (ROW_Y + stack * (lane_depth - 1)) + GAP
    offsets = [[0.0], *[[((len(st) - 1) / 2 - b) * pitch for b in range(len(st))]
                        for st in stages], [0.0]]
    fig = go.Figure()
    prefix = _draw_modules(fig, names, col_of, offsets)
    traces = _markers(groups, branch_of, offsets, stack, names)
    _add_markers(fig, traces)
    if not recs:
        fig.add_annotation(text="no collectives in this trace", x=len(offsets) / 2 - 0.5,
                           y=ROW_Y + 0.35, showarrow=False, font={"size": 14})
    reach = max(abs(c) for cs in offsets for c in cs) + ROW_Y + stack * (deepest - 1) + 0.55
    fig.update_xaxes(visible=False, range=[-1.7, len(offsets) - 0.4])
    fig.update_yaxes(visible=False, range=[-reach, reach])
    fwd = sum(len(rs) for k, rs in groups.items() if k[0] == "forward")
    bwd = sum(len(rs) for k, rs in groups.items() if k[0] != "forward")
    sub = (f"rank {pick}: {fwd} collective(s) in the forward pass, {bwd} in the backward pass"
           + (f" · modules under {prefix.rstrip('.')}" if prefix else ""))
    notes = _notes([m for t in traces.values() for m in t["meta"]], stages)
    if notes:
        fig.add_annotation(text="<br>".join(notes), x=0, y=0, xref="paper", yref="paper",
                           yanchor="top", xanchor="left", align="left", showarrow=False,
                           yshift=-4,
                           font={"size": 13, "color": "#424242"})
    style(fig, title or "Where the collectives sit: forward above, backward below", sub,
          height=int(170 + 85 * 2 * reach) + 18 * max(0, len(notes) - 2),
          width=min(1200, max(900 if len(notes) > 2 else 0, 120 * len(offsets) + 200)),
          legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1,
                  "xanchor": "right"},
          margin={"t": 110, "l": 20, "r": 20, "b": 60 + 18 * max(0, len(notes) - 2)})
    return fig


def _one_rank(trace, rank: int | None) -> tuple[int, list[dict]]:
    """(the rank drawn, its records in call order)."""
    recs = flatten(trace)
    ranks = sorted({r.get("rank", 0) for r in recs})
    pick = rank if rank is not None else (ranks[0] if ranks else 0)
    if recs and pick not in ranks:
        raise ValueError(f"no records of rank {pick} in the trace (ranks: {ranks})")
    return pick, sorted((r for r in recs if r.get("rank", 0) == pick),
                        key=lambda r: r.get("seq", 0))


def _place(recs: list[dict], modules) -> tuple[list[str], list, list[tuple]]:
    """(module names, stages: columns of sibling indices, (record, module indices, side)
    of every record); records outside the modules get a column of their own."""
    names, stages = split_modules(modules) if modules is not None else (module_order(recs),
                                                                          None)
    found = [(rec, match(rec.get("module") or "", names)) for rec in recs]
    placed = [(rec, w) for rec, w in found if w]
    sides = [(rec, w, side_in_context(rec, w, placed)) for rec, w in placed]
    if stages is None:
        stages = stages_from_trace(names, sides)
    if len(placed) < len(found):
        names = [*names, "(outside the modules)"]
        stages = [*stages, [len(names) - 1]]
        sides += [(rec, [len(names) - 1], side_in_context(rec, [len(names) - 1], []))
                  for rec, w in found if not w]
    return names, stages, sides


def _group(sides, stages, col_of) -> tuple[dict[tuple, list[dict]], dict[tuple, int | None]]:
    """Identical collectives on one spot: (phase, edge, lane, op, side) -> records, and the
    branch (a module index, or None) each spot belongs to."""
    groups: dict[tuple, list[dict]] = {}
    branch_of: dict[tuple, int | None] = {}
    for rec, where, sd in sides:
        edge, lane, branch = _spot(where, sd, stages, col_of)
        key = (rec.get("phase"), edge, lane, rec.get("op"), sd)
        groups.setdefault(key, []).append(rec)
        branch_of[key] = branch
    return groups, branch_of


def _draw_modules(fig: go.Figure, names: list[str], col_of, offsets) -> str:
    """The modules' boxes and names, the edges between them, the passes' labels; returns
    the prefix the names were shown without."""
    nodes = ["input", *names, "loss"]
    labels, prefix = _display(names)
    xs = [0, *[col_of[i][0] for i in range(len(names))], len(offsets) - 1]
    ys = [0.0, *[offsets[col_of[i][0]][col_of[i][1]] for i in range(len(names))], 0.0]
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        dashed = k in (0, len(nodes) - 1)
        fig.add_shape(type="rect", x0=x - BOX[0], x1=x + BOX[0], y0=y - BOX[1], y1=y + BOX[1],
                      line={"color": "#9e9e9e" if dashed else "#424242", "width": 1.5,
                            "dash": "dot" if dashed else "solid"},
                      fillcolor="white" if dashed else NODE_COLOR, layer="below")
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="text", name="modules",
        text=["<i>input x</i>", *labels, "<i>loss</i>"], textfont={"size": 12},
        hovertext=nodes, hoverinfo="text", showlegend=False, meta=nodes))
    _edges(fig, offsets)
    for y, text, phase in ((ROW_Y, "forward →", "forward"), (-ROW_Y, "← backward", "backward")):
        fig.add_annotation(x=-0.5, y=y, xref="x", yref="y", text=f"<b>{text}</b>",
                           showarrow=False, xanchor="right",
                           font={"color": PHASE_COLORS[phase], "size": 14})
    return prefix


def _markers(groups, branch_of, offsets, stack: float, names) -> dict[tuple, dict]:
    """(phase, op) -> the marker trace's columns (x, y, text, custom, meta, pos)."""
    slot: dict[tuple, int] = {}
    traces: dict[tuple, dict] = {}
    for (phase, edge, lane, op, sd), rs in groups.items():
        j = slot.get((phase, edge, lane), 0)
        slot[(phase, edge, lane)] = j + 1
        x, c = _marker_at(edge, lane, offsets)
        letter, words = role(rs[0], sd)
        cause = rs[0].get("cause") or ""
        if cause in ("f", "g"):  # tplab.megatron's operator says it: no guessing
            letter = cause
        short = short_cause(cause)
        count = f" ×{len(rs)}" if len(rs) > 1 else ""
        branch = branch_of[(phase, edge, lane, op, sd)]
        t = traces.setdefault((phase, op), {"x": [], "y": [], "text": [], "custom": [],
                                            "meta": [], "pos": []})
        # a branch's label leans away from the curves that fan out at the column's edge
        lean = "" if lane is None else " right" if lane[0] == "in" else " left"
        t["pos"].append(("top" if phase == "forward" else "bottom") + (lean or " center"))
        t["x"].append(x)
        t["y"].append(c + (1 if phase == "forward" else -1) * (ROW_Y + stack * j))
        t["text"].append((f"<b>{letter}</b>: {op_words(op)}{count}" if letter
                          else f"{op_words(op)}{count}") + (f"<br>{short}" if short else ""))
        t["custom"].append([words, rs[0].get("module") or "(none)", sd,
                            "×".join(map(str, rs[0].get("shape") or [])),
                            human_bytes(sum(r.get("bytes", 0) or 0 for r in rs)), len(rs),
                            rs[0].get("group", "?"), cause or "?", conjugate(rs[0])])
        t["meta"].append({"module": rs[0].get("module") or "", "edge": edge,
                          "branch": names[branch] if branch is not None else None,
                          "side": sd, "phase": phase, "op": op, "group": rs[0].get("group"),
                          "count": len(rs), "role": letter, "cause": cause})
    return traces


def _marker_at(edge: int, lane, offsets) -> tuple[float, float]:
    """(x, y of the row's middle) of a marker on `edge`: mid-edge, or on a branch's lane."""
    fan_src, fan_dst = len(offsets[edge]) > 1, len(offsets[edge + 1]) > 1
    if lane is None:
        return edge + (0.5 if fan_src == fan_dst else 0.27 if fan_dst else 0.73), 0.0
    if lane[0] == "in":
        return edge + 0.72, offsets[edge + 1][lane[1]]
    return edge + 0.28, offsets[edge][lane[1]]


def _add_markers(fig: go.Figure, traces: dict[tuple, dict]) -> None:
    for (phase, op), t in traces.items():
        fig.add_trace(go.Scatter(
            x=t["x"], y=t["y"], mode="markers+text", text=t["text"],
            textposition=t["pos"],
            textfont={"color": PHASE_COLORS.get(phase, "#424242"), "size": 13},
            name=f"{phase} {op_words(op)}", meta=t["meta"], customdata=t["custom"],
            marker={"symbol": op_symbol(op), "size": 18, "color": PHASE_COLORS.get(phase),
                    "line": {"color": "white", "width": 2}},
            hovertemplate=("<b>%{customdata[0]}</b><br>module: %{customdata[1]} "
                           "(%{customdata[2]} edge)<br>shape: %{customdata[3]}"
                           "<br>bytes: %{customdata[4]} in %{customdata[5]} call(s)"
                           " on the %{customdata[6]} group<br>why: %{customdata[7]}"
                           "<br>its conjugate: %{customdata[8]}<extra></extra>")))


def _notes(metas: list[dict], stages) -> list[str]:
    """The figure's footnotes: the roles drawn, and the branches' rules where there are."""
    letters = {m["role"] for m in metas}
    notes = [text for letter, text in (
        ("f", "<b>f</b>: identity forward, all-reduce backward (into a column-parallel layer)"),
        ("g", "<b>g</b>: all-reduce forward, identity backward (out of a row-parallel layer)"),
        ("dW", "<b>dW</b>: a replicated weight's gradient, summed over the ranks"))
        if letter in letters]
    if any(len(st) > 1 for st in stages):
        notes.append("stacked modules read the same input (parallel branches); in the "
                     "backward pass their dL/dx add up where the branches join")
    if any(m["role"] == "f" and m["branch"] for m in metas):
        notes.append("an <b>f</b> on each branch sums that branch's part of dL/dx over the "
                     "ranks; one f on the shared edge would sum the branches first, once")
    return notes
