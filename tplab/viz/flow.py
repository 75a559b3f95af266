"""`grad_flow`: the model's modules in a row, forward above, backward below, collectives on edges.

This is the picture of Megatron-LM's f and g (Shoeybi et al. 2019, fig. 3) drawn from a
real trace rather than by hand. A collective is drawn on the edge where it happens:
reductions follow the compute that made the partial sums (forward: a module's output edge;
backward: its input edge, the gradient flowing right to left), gathers precede the compute
that needs the whole (forward: input edge; backward: output edge). So g's all-reduce lands
on the forward edge out of a row-parallel layer and f's on the backward edge into a
column-parallel one. A record with an "edge" key ("input" or "output") overrides the rule.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import plotly.graph_objects as go

from tplab.viz.palette import NODE_COLOR, PHASE_COLORS, human_bytes, op_symbol, op_words, style
from tplab.viz.timeline import flatten

REDUCTIONS = {"all_reduce", "reduce_scatter"}
ROW_Y = 0.8  # height of the forward row (the backward row is at -ROW_Y)
STACK = 0.42  # spacing of several collectives on one edge

# (op, phase, side) -> (letter drawn, what it does, for the hover)
ROLES = {
    ("all_reduce", "forward", "output"):
        ("g", "g: sums the partial outputs of a row-parallel layer"),
    ("all_reduce", "backward", "input"):
        ("f", "f's backward: sums each rank's part of dL/dx for a column-parallel layer"),
    ("all_gather", "forward", "input"):
        ("", "gathers the sequence shards of the input (sequence parallelism)"),
    ("reduce_scatter", "backward", "input"):
        ("", "conjugate of the forward all-gather: sums dL/dx and scatters it by sequence"),
    ("reduce_scatter", "forward", "output"):
        ("", "sums the partial outputs and scatters them by sequence (sequence parallelism)"),
    ("all_gather", "backward", "output"):
        ("", "conjugate of the forward reduce-scatter: gathers dL/dy's sequence shards"),
}


def _role(rec: dict, sd: str) -> tuple[str, str]:
    op, phase = rec.get("op"), rec.get("phase")
    if op == "all_reduce" and phase == "backward" and len(rec.get("shape") or []) <= 1:
        # activations are (batch, seq, dim): a 1-D message is a parameter's gradient
        return "dW", "sums a replicated weight's gradient (a norm under sequence parallelism)"
    return ROLES.get((op, phase, sd), ("", f"{op_words(op)} in the {phase} pass"))


def side(rec: dict) -> str:
    """"input" or "output": which edge of its module a collective sits on (see module doc)."""
    if rec.get("edge") in ("input", "output"):
        return rec["edge"]
    reduce, forward = rec.get("op") in REDUCTIONS, rec.get("phase") == "forward"
    return "output" if reduce == forward else "input"


def _side_in_context(rec: dict, where: list[int], placed: list[tuple]) -> str:
    """`side`, but for a collective of a module that holds several drawn ones (a hook on a
    whole block, say) the order of the trace decides: in the forward pass, after its
    children's collectives means at its output; in the backward pass, after them means at
    its input (gradients flow from the output back). With nothing to compare, `side`.
    """
    if len(where) < 2 or rec.get("edge") in ("input", "output"):
        return side(rec)
    inner = set(where)
    seqs = [r.get("seq", 0) for r, w in placed if r is not rec and r.get("phase") ==
            rec.get("phase") and set(w) < inner]
    seq, forward = rec.get("seq", 0), rec.get("phase") == "forward"
    if any(s < seq for s in seqs):
        return "output" if forward else "input"
    if any(s > seq for s in seqs):
        return "input" if forward else "output"
    return side(rec)


def _match(module: str, names: Sequence[str]) -> list[int]:
    """Indices of the listed modules that `module` is, sits inside, or contains.

    "" (the root, e.g. a hook on the whole model) contains every listed module.
    """
    if not module:
        return list(range(len(names)))
    if module in names:
        return [names.index(module)]
    inside = [i for i, n in enumerate(names) if n and module.startswith(n + ".")]
    if inside:
        return [max(inside, key=lambda i: len(names[i]))]
    suffix = [i for i, n in enumerate(names)
              if n and (module.endswith("." + n) or n.endswith("." + module))]
    if suffix:
        return suffix[:1]
    return [i for i, n in enumerate(names) if n.startswith(module + ".")]


def _merge(forward: list[str], backward: list[str]) -> list[str]:
    """Forward order, with names seen only in the backward pass put where it says.

    `backward` is in backward order (last module first). A backward-only name goes before
    the first forward-known name that the backward pass reaches before it, else after the
    last one it reaches after it, else first (f's all-reduce, at a column-parallel input,
    is the usual backward-only collective and precedes the row-parallel g).
    """
    order = list(forward)
    rev = backward[::-1]  # now in forward order
    for i, name in enumerate(rev):
        if name in order:
            continue
        later = [n for n in rev[i + 1:] if n in order]
        earlier = [n for n in rev[:i] if n in order]
        if later:
            order.insert(order.index(later[0]), name)
        elif earlier:
            order.insert(order.index(earlier[-1]) + 1, name)
        else:
            order.insert(0, name)
    return order


def module_order(recs: Sequence[dict]) -> list[str]:
    """The modules of a trace in forward order, inferred from the order of its collectives.

    Only a guess where a module shows up in the backward pass alone: pass `modules` to
    `grad_flow` for the model's real order.
    """
    recs = sorted(recs, key=lambda r: r.get("seq", 0))
    parent = lambda m: m.rpartition(".")[0]
    fwd, bwd = [], []
    for rec in recs:
        m = rec.get("module") or ""
        seen = fwd if rec.get("phase") == "forward" else bwd
        if m and m not in seen:
            seen.append(m)
    order = []
    for p in _merge(list(dict.fromkeys(map(parent, fwd))), list(dict.fromkeys(map(parent, bwd)))):
        order += _merge([m for m in fwd if parent(m) == p], [m for m in bwd if parent(m) == p])
    return order


def _display(names: list[str]) -> tuple[list[str], str]:
    """Strip the dotted prefix all modules share; break long names at dots."""
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    prefix = prefix[: prefix.rfind(".") + 1] if "." in prefix else ""
    out = []
    for n in names:
        short = n[len(prefix):] or n
        out.append(re.sub(r"([._])", r"\1<br>", short) if len(short) > 9 else short)
    return out, prefix


def grad_flow(trace, modules: Sequence[str] | None = None, *, rank: int | None = None,
              title: str | None = None) -> go.Figure:
    """Draw where each collective of one rank's trace happens on the model's data flow.

    `trace`: records of one rank (or of several: `rank` picks one, default the lowest).
    `modules`: the model's modules in forward order; with it, modules with no collective
    are drawn too. Marker traces' `meta` holds one dict per marker: module, edge (0 is
    the edge from the input into the first module), side, phase, op, count, role.
    """
    recs = flatten(trace)
    ranks = sorted({r.get("rank", 0) for r in recs})
    pick = rank if rank is not None else (ranks[0] if ranks else 0)
    if recs and pick not in ranks:
        raise ValueError(f"no records of rank {pick} in the trace (ranks: {ranks})")
    recs = sorted((r for r in recs if r.get("rank", 0) == pick), key=lambda r: r.get("seq", 0))
    names = list(modules) if modules is not None else module_order(recs)
    placed, stray = [], []
    for rec in recs:
        where = _match(rec.get("module") or "", names)
        (placed if where else stray).append((rec, where))
    if stray:
        names = [*names, "(outside the modules)"]
        placed += [(rec, [len(names) - 1]) for rec, _ in stray]
    # Group identical collectives on one edge: (phase, edge, op) -> records.
    groups: dict[tuple, list[dict]] = {}
    for rec, where in placed:
        sd = _side_in_context(rec, where, placed)
        edge = (where[0] if sd == "input" else where[-1] + 1)  # node k+1 is names[k]
        groups.setdefault((rec.get("phase"), edge, rec.get("op"), sd), []).append(rec)

    fig = go.Figure()
    nodes = ["input", *names, "loss"]
    labels, prefix = _display(names)
    for k in range(len(nodes)):
        dashed = k in (0, len(nodes) - 1)
        fig.add_shape(type="rect", x0=k - 0.4, x1=k + 0.4, y0=-0.3, y1=0.3,
                      line={"color": "#9e9e9e" if dashed else "#424242", "width": 1.5,
                            "dash": "dot" if dashed else "solid"},
                      fillcolor="white" if dashed else NODE_COLOR, layer="below")
    fig.add_trace(go.Scatter(
        x=list(range(len(nodes))), y=[0] * len(nodes), mode="text", name="modules",
        text=["<i>input x</i>", *labels, "<i>loss</i>"], textfont={"size": 12},
        hovertext=nodes, hoverinfo="text", showlegend=False, meta=nodes))
    for e in range(len(nodes) - 1):  # forward arrows above, backward arrows below
        for y, tail, head, phase in ((ROW_Y, e + 0.14, e + 0.86, "forward"),
                                     (-ROW_Y, e + 0.86, e + 0.14, "backward")):
            fig.add_annotation(x=head, y=y, ax=tail, ay=y, xref="x", yref="y", axref="x",
                               ayref="y", showarrow=True, arrowhead=2, arrowsize=1.2,
                               arrowwidth=2, arrowcolor=PHASE_COLORS[phase], opacity=0.55,
                               text="")
    for y, text, phase in ((ROW_Y, "forward →", "forward"), (-ROW_Y, "← backward", "backward")):
        fig.add_annotation(x=-0.5, y=y, xref="x", yref="y", text=f"<b>{text}</b>",
                           showarrow=False, xanchor="right",
                           font={"color": PHASE_COLORS[phase], "size": 14})

    stacked: dict[tuple, int] = {}
    traces: dict[tuple, dict] = {}
    for (phase, edge, op, sd), rs in groups.items():
        j = stacked.get((phase, edge), 0)
        stacked[(phase, edge)] = j + 1
        sign = 1 if phase == "forward" else -1
        letter, role = _role(rs[0], sd)
        count = f" ×{len(rs)}" if len(rs) > 1 else ""
        t = traces.setdefault((phase, op), {"x": [], "y": [], "text": [], "custom": [],
                                            "meta": []})
        t["x"].append(edge + 0.5)
        t["y"].append(sign * (ROW_Y + STACK * j))
        t["text"].append(f"<b>{letter}</b>: {op_words(op)}{count}" if letter
                         else f"{op_words(op)}{count}")
        t["custom"].append([role, rs[0].get("module") or "(none)", sd,
                            "×".join(map(str, rs[0].get("shape") or [])),
                            human_bytes(sum(r.get("bytes", 0) or 0 for r in rs)), len(rs)])
        t["meta"].append({"module": rs[0].get("module") or "", "edge": edge, "side": sd,
                          "phase": phase, "op": op, "count": len(rs), "role": letter})
    for (phase, op), t in traces.items():
        fig.add_trace(go.Scatter(
            x=t["x"], y=t["y"], mode="markers+text", text=t["text"],
            textposition="top center" if phase == "forward" else "bottom center",
            textfont={"color": PHASE_COLORS.get(phase, "#424242"), "size": 13},
            name=f"{phase} {op_words(op)}", meta=t["meta"], customdata=t["custom"],
            marker={"symbol": op_symbol(op), "size": 18, "color": PHASE_COLORS.get(phase),
                    "line": {"color": "white", "width": 2}},
            hovertemplate=("<b>%{customdata[0]}</b><br>module: %{customdata[1]} "
                           "(%{customdata[2]} edge)<br>shape: %{customdata[3]}"
                           "<br>bytes: %{customdata[4]} in %{customdata[5]} call(s)"
                           "<extra></extra>")))
    if not recs:
        fig.add_annotation(text="no collectives in this trace", x=len(nodes) / 2 - 0.5,
                           y=ROW_Y + 0.35, showarrow=False, font={"size": 14})
    deepest = max(stacked.values(), default=1)
    reach = ROW_Y + STACK * (deepest - 1) + 0.55
    fig.update_xaxes(visible=False, range=[-1.7, len(nodes) - 0.4])
    fig.update_yaxes(visible=False, range=[-reach, reach])
    fwd = sum(len(rs) for k, rs in groups.items() if k[0] == "forward")
    bwd = sum(len(rs) for k, rs in groups.items() if k[0] != "forward")
    sub = (f"rank {pick}: {fwd} collective(s) in the forward pass, {bwd} in the backward pass"
           + (f" · modules under {prefix.rstrip('.')}" if prefix else ""))
    letters = {m["role"] for t in traces.values() for m in t["meta"]}
    notes = [text for letter, text in (
        ("f", "<b>f</b>: identity forward, all-reduce backward (into a column-parallel layer)"),
        ("g", "<b>g</b>: all-reduce forward, identity backward (out of a row-parallel layer)"),
        ("dW", "<b>dW</b>: a replicated weight's gradient, summed over the ranks"))
        if letter in letters]
    if notes:
        fig.add_annotation(text="<br>".join(notes), x=0, y=0, xref="paper", yref="paper",
                           yanchor="top", xanchor="left", showarrow=False, yshift=-4,
                           font={"size": 13, "color": "#424242"})
    style(fig, title or "Where the collectives sit: forward above, backward below", sub,
          height=int(400 + 140 * (deepest - 1)), width=min(1200, 120 * len(nodes) + 200),
          legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1,
                  "xanchor": "right"},
          margin={"t": 110, "l": 20, "r": 20, "b": 60})
    return fig
