"""Figures of the cost model, drawn in the notebook from `sweep` rows and collective times.

- `step_breakdown`: compute and TP communication per TP degree, stacked, one panel per model.
- `step_lines`: step time against TP degree, one line per hardware variant (log-log).
- `collective_lines`: time of one collective against message size, one line per link.
- `memory_bars`: per-GPU memory per TP degree (parameters, gradients, optimizer state,
  activations stacked), with a line at each GPU's memory.
- `sensitivity`: where TP stops paying (the fastest TP degree) against one knob per panel
  (NICs per node, latency, ...), one line per overlap mode.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tplab.cost.collectives import collective_time
from tplab.cost.hardware import GPU_MEMORY, Link
from tplab.cost.step import best_tp
from tplab.viz.palette import BAD_COLOR, PHASE_COLORS, human_bytes, style

COMPUTE_COLOR = "#8da0cb"
COMM_COLOR = PHASE_COLORS["backward"]
MEMORY_PARTS = (("param_bytes", "parameters", "#66c2a5"), ("grad_bytes", "gradients", "#fc8d62"),
                ("optimizer_bytes", "optimizer state", "#8da0cb"),
                ("activation_bytes", "activations", "#e78ac3"))
LINE_COLORS = ("#1f4e9c", "#b2182b", "#2e7d32", "#6a3d9a", "#ff7f00", "#616161")


def step_breakdown(panels: dict[str, list[dict]], title: str = "Step time against TP degree",
                   subtitle: str | None = None) -> go.Figure:
    """One panel per label of `sweep` rows: stacked compute and the TP communication left on
    the critical path (ms: `exposed_comm_s`, all of it without overlap), the fastest TP
    degree (objective "latency") marked, and the degrees whose TP group crosses nodes
    shaded."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=list(panels),
                        horizontal_spacing=0.08)
    for col, rows in enumerate(panels.values(), start=1):
        x = [str(r["tp"]) for r in rows]
        for key, name, color in (("compute_s", "compute", COMPUTE_COLOR),
                                 ("exposed_comm_s", "TP communication", COMM_COLOR)):
            fig.add_bar(x=x, y=[r.get(key, r["tp_comm_s"]) * 1e3 for r in rows], name=name,
                        marker_color=color,
                        showlegend=col == 1, legendgroup=name, row=1, col=col,
                        customdata=[[r["link"], r["comm_fraction"]] for r in rows],
                        hovertemplate="TP %{x}: %{y:.1f} ms<br>link %{customdata[0]}<br>"
                                      "comm %{customdata[1]:.0%}<extra>" + name + "</extra>")
        crossing = [i for i, r in enumerate(rows) if r["crosses_nodes"]]
        if crossing:   # category axes place shapes by index
            fig.add_vrect(x0=crossing[0] - 0.5, x1=len(rows) - 0.5, fillcolor="#e8e8e8",
                          opacity=0.5, layer="below", line_width=0, row=1, col=col,
                          annotation_text="crosses nodes", annotation_position="top left")
        i = [r["tp"] for r in rows].index(best_tp(rows, "latency"))
        fig.add_annotation(x=i, y=rows[i]["step_s"] * 1e3, text="fastest",
                           showarrow=True, arrowhead=2, ax=0, ay=-40, row=1, col=col)
        fig.update_xaxes(title_text="TP degree", type="category", row=1, col=col)
    fig.update_yaxes(title_text="ms per micro-batch (all layers)", row=1, col=1)
    return style(fig, title, subtitle, barmode="stack", height=430)


def step_lines(lines: dict[str, list[dict]], title: str = "Step time against TP degree",
               subtitle: str | None = "solid: step time; dotted: its TP communication"
               ) -> go.Figure:
    """Step time (solid) and its TP communication (dotted) per TP degree, one colour per
    label."""
    fig = go.Figure()
    for i, (label, rows) in enumerate(lines.items()):
        color = LINE_COLORS[i % len(LINE_COLORS)]
        tps = [r["tp"] for r in rows]
        fig.add_scatter(x=tps, y=[r["step_s"] * 1e3 for r in rows], name=label,
                        mode="lines+markers", line={"color": color})
        comm = [r for r in rows if r["tp"] > 1]
        fig.add_scatter(x=[r["tp"] for r in comm], y=[r["tp_comm_s"] * 1e3 for r in comm],
                        name=f"{label}: TP comm", mode="lines", legendgroup=label,
                        showlegend=False, line={"color": color, "dash": "dot"})
    fig.update_xaxes(title_text="TP degree", type="log", tickvals=tps)
    fig.update_yaxes(title_text="ms per micro-batch", type="log")
    return style(fig, title, subtitle, height=430)


def collective_lines(links: dict[str, Link], op: str, group_size: int,
                     sizes=tuple(2**k for k in range(10, 31, 2)),
                     title: str | None = None) -> go.Figure:
    """Time of `op` over `group_size` ranks against message size, one line per link; the
    bend is where the latency term gives way to the bytes term."""
    fig = go.Figure()
    for i, (label, link) in enumerate(links.items()):
        fig.add_scatter(x=list(sizes), y=[collective_time(op, s, group_size, link) * 1e6
                                          for s in sizes], name=label, mode="lines+markers",
                        line={"color": LINE_COLORS[i % len(LINE_COLORS)]},
                        text=[human_bytes(s) for s in sizes],
                        hovertemplate="%{text}: %{y:.1f} us")
    fig.update_xaxes(title_text="message bytes", type="log")
    fig.update_yaxes(title_text="microseconds", type="log")
    title = title or f"{op.replace('_', '-')} over {group_size} ranks"
    return style(fig, title, "NCCL's model: latency term + bytes term, its protocol by size",
                 height=400)


def memory_bars(rows: list[dict], title: str = "Memory per GPU against TP degree",
                subtitle: str | None = None, lines: dict[str, float] = GPU_MEMORY,
                memory: float | None = None, unit: str = "GB", x: list | None = None,
                x_title: str = "TP degree") -> go.Figure:
    """Stacked parameters, gradients, optimizer state and activations (in `unit`: "GB",
    "MB" or "KB" per GPU) of `sweep` rows (or `tplab.memory` summaries), one bar per TP
    degree (or per label of `x`), a dotted line at each of `lines` (GPU memory in bytes)
    and a solid one at `memory` (the chosen GPU's), the smallest degree that fits marked.
    Bars far above the lines are clipped, their totals written at the top."""
    scale = {"GB": 1e9, "MB": 1e6, "KB": 1e3}[unit]
    fig = go.Figure()
    x = x or [str(r["tp"]) for r in rows]
    for key, name, color in MEMORY_PARTS:
        fig.add_bar(x=x, y=[r[key] / scale for r in rows], name=name, marker_color=color,
                    hovertemplate="%{x}: %{y:.1f} " + unit + "<extra>" + name + "</extra>")
    for label, nbytes in lines.items():
        if memory is not None and nbytes == memory:
            continue
        fig.add_hline(y=nbytes / 1e9, line={"dash": "dot", "color": "#9e9e9e", "width": 1},
                      annotation_text=label, annotation_position="top right",
                      annotation_font_color="#757575")
    if memory is not None:
        fig.add_hline(y=memory / 1e9, line={"color": BAD_COLOR, "width": 2},
                      annotation_text=f"{memory / 1e9:.0f} GB usable",
                      annotation_position="top right",
                      annotation_font_color=BAD_COLOR)
        fits = [i for i, r in enumerate(rows) if r["memory_bytes"] <= memory]
        if fits:
            i = fits[0]
            fig.add_annotation(x=i, y=rows[i]["memory_bytes"] / 1e9, text="fits",
                               showarrow=True, arrowhead=2, ax=0, ay=-40)
    # bars far above the GPUs would squash the lines: clip them, and write their totals
    marks = [*lines.values(), *([memory] if memory is not None else [])]
    ceiling = 1.6 * max(marks) / scale if marks else None
    if ceiling is not None and max(r["memory_bytes"] for r in rows) / scale > ceiling:
        fig.update_yaxes(range=[0, ceiling])
        for i, r in enumerate(rows):
            if r["memory_bytes"] / scale > ceiling:
                fig.add_annotation(x=i, y=ceiling, yanchor="top", showarrow=False,
                                   text=f"{r['memory_bytes'] / scale:,.0f} {unit} ↑",
                                   bgcolor="white")
    fig.update_xaxes(title_text=x_title, type="category")
    fig.update_yaxes(title_text=f"{unit} per GPU")
    return style(fig, title, subtitle, barmode="stack", height=430)


def sensitivity(panels: dict[str, dict[str, list[tuple]]], title: str = "Where TP stops paying",
                subtitle: str | None = None, y_title: str = "fastest TP degree") -> go.Figure:
    """One panel per knob: {panel title: {line label: [(x, fastest TP degree), ...]}}, the x
    values as categories (NIC counts, latencies), the TP degree on a log2 axis."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=list(panels),
                        horizontal_spacing=0.07, shared_yaxes=True)
    labels = list(dict.fromkeys(label for lines in panels.values() for label in lines))
    for col, lines in enumerate(panels.values(), start=1):
        for label, points in lines.items():
            i = labels.index(label)   # dashes and shrinking markers: coinciding lines show
            color = LINE_COLORS[i % len(LINE_COLORS)]
            fig.add_scatter(x=[str(x) for x, _ in points], y=[tp for _, tp in points],
                            name=label, legendgroup=label, showlegend=col == 1,
                            mode="lines+markers", row=1, col=col,
                            line={"color": color, "dash": ("solid", "dash", "dot")[i % 3],
                                  "width": 4 - i % 3},
                            marker={"size": 12 - 3 * (i % 3)},
                            hovertemplate="%{x}: TP %{y}<extra>" + label + "</extra>")
        fig.update_xaxes(type="category", row=1, col=col)
    tps = sorted({tp for lines in panels.values() for pts in lines.values() for _, tp in pts})
    fig.update_yaxes(type="log", tickvals=tps, ticktext=[str(t) for t in tps])
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    return style(fig, title, subtitle, height=420)
