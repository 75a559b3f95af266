"""`grad_error`: a grad_check report as a picture: how far each tensor is from the truth.

Two panels on one log axis: the error of every output and gradient against the
single-device reference, and the spread across ranks of tensors that should be equal
(a replicated bias's gradient, the input gradient after f's all-reduce). An error of
exactly zero has no place on a log axis: it is drawn at a floor, with its own marker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tplab.viz.palette import BAD_COLOR, EXACT_COLOR, OK_COLOR, style

KIND_ORDER = ("output", "input_grad", "param_grad", "replica_spread")
KIND_WORDS = {"output": "output", "input_grad": "dL/dx", "param_grad": "dL/dW",
              "replica_spread": "spread"}
STATUS = {  # status -> (legend name, colour, symbol)
    "ok": ("within tolerance", OK_COLOR, "circle"),
    "bad": ("over tolerance", BAD_COLOR, "x"),
    "plain": ("error", "#1f4e9c", "circle"),
    "exact": ("exactly 0 (drawn at the floor)", EXACT_COLOR, "diamond-open"),
}


def report_rows(report) -> list[dict]:
    """Rows of a grad_check report, a list of rows, or a dict with "rows"."""
    if hasattr(report, "rows"):
        return [dict(r) for r in report.rows]
    if isinstance(report, Mapping):
        return [dict(r) for r in report["rows"]]
    return [dict(r) for r in report]


def _status(row: dict, atol: float | None) -> str:
    """The row's own verdict ("ok", from grad_check's atol + rtol * scale) wins over atol."""
    v = float(row.get("max_abs", 0.0))
    if v == 0:
        return "exact"
    if not math.isfinite(v) or row.get("ok") is False:
        return "bad"
    if row.get("ok") is True:
        return "ok"
    if atol is None:
        return "plain"
    return "ok" if v <= atol else "bad"


def _finite_pos(v) -> bool:
    return isinstance(v, int | float) and math.isfinite(v) and v > 0


def floor_for(values: list[float], atol: float | None) -> float:
    """A power of ten two decades under the smallest nonzero error (and the tolerance)."""
    pos = [v for v in values if v > 0 and math.isfinite(v)] + ([atol] if atol else [])
    if not pos:
        return 1e-12
    return 10.0 ** (math.floor(math.log10(min(pos))) - 2)


def grad_error(report, *, atol: float | None = None, floor: float | None = None,
               title: str | None = None) -> go.Figure:
    """Per-tensor max |error| on a log axis, with the tolerance drawn as a line.

    `report`: a grad_check report (its `.rows`, and `.atol` if it has one) or a list of
    rows {name, kind, max_abs, max_rel}. `atol` defaults to the report's; a row's own "ok"
    (grad_check's atol + rtol * max|reference|) decides its colour when it has one. Zeros
    are clamped to `floor` and marked exact. Each marker trace's `meta` lists its rows with
    name, kind, max_abs, max_rel, status ("ok", "bad", "exact" or "plain") and x (drawn).
    """
    # an unpaired parameter was not compared: it has no error to draw (the table says it)
    rows = [r for r in report_rows(report) if r.get("kind") != "unpaired"]
    if atol is None:
        atol = getattr(report, "atol", None)
    rtol = getattr(report, "rtol", None)
    values = [float(r.get("max_abs", 0.0)) for r in rows]
    floor = floor or floor_for(values, atol)
    finite = [v for v in values if math.isfinite(v)] + [floor]
    ceiling = max(finite + ([atol] if atol else [])) * 10  # where a NaN/inf is drawn
    panels = [[r for r in rows if r.get("kind") != "replica_spread"],
              [r for r in rows if r.get("kind") == "replica_spread"]]
    names = ("compared with the single-device reference",
             "spread across ranks of tensors that should be equal")
    used = [(p, n) for p, n in zip(panels, names, strict=True) if p] or [([], names[0])]
    fig = make_subplots(rows=len(used), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[n for _, n in used],
                        row_heights=[max(len(p), 1) for p, _ in used])
    shown: set[str] = set()
    for i, (prow, _) in enumerate(used, start=1):
        _panel(fig, i, prow, floor, ceiling, atol, rtol, shown)
    if atol:
        fig.add_vline(x=atol, line={"color": BAD_COLOR, "dash": "dash", "width": 2})
        name = f"atol {atol:g}" + (f" (tolerance = atol + rtol {rtol:g} × max|ref|)"
                                  if rtol else " (tolerance)")
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=name,
                                 line={"color": BAD_COLOR, "dash": "dash", "width": 2},
                                 meta={"atol": atol}))
    bad = sum(1 for r in rows if _status(r, atol) == "bad")
    exact = sum(1 for v in values if v == 0)
    sub = (f"{len(rows)} tensors · {exact} exact · "
           + (f"{bad} over the tolerance" if atol or any("tol" in r for r in rows)
              else "no tolerance given")
           + f" · zeros drawn at {floor:g}")
    n = len(rows)
    style(fig, title or "How far each tensor is from the truth (max |error|, log scale)", sub,
          height=max(380, 200 + 26 * n + 60 * len(used)), width=1000,
          margin={"t": 120, "l": 20, "r": 30, "b": 60}, legend={"title": {"text": ""}})
    fig.update_xaxes(type="log", exponentformat="power", showgrid=True)
    fig.update_xaxes(title_text="max |error| (log scale)", row=len(used), col=1)
    return fig


def _panel(fig, i: int, prow: list[dict], floor: float, ceiling: float, atol, rtol,
           shown: set[str]) -> None:
    """Panel i of `grad_error`: a stem and a marker per row, and each tensor's tolerance."""
    prow = sorted(prow, key=lambda r: KIND_ORDER.index(r.get("kind"))
                  if r.get("kind") in KIND_ORDER else len(KIND_ORDER))
    labels = [f"{r.get('name')} · {KIND_WORDS.get(r.get('kind'), r.get('kind'))}"
              for r in prow]
    drawn = []
    for r in prow:
        v = float(r.get("max_abs", 0.0))
        drawn.append(floor if v == 0 else v if math.isfinite(v) else ceiling)
    stems_x, stems_y = [], []
    for x, y in zip(drawn, labels, strict=True):
        stems_x += [floor, x, None]
        stems_y += [y, y, None]
    fig.add_trace(go.Scatter(x=stems_x, y=stems_y, mode="lines", showlegend=False,
                             hoverinfo="skip", line={"color": "#bdbdbd", "width": 2}),
                  row=i, col=1)
    for status, (legend, color, symbol) in STATUS.items():
        pick = [j for j, r in enumerate(prow) if _status(r, atol) == status]
        if not pick:
            continue
        fig.add_trace(go.Scatter(
            x=[drawn[j] for j in pick], y=[labels[j] for j in pick], mode="markers",
            name=legend, legendgroup=status, showlegend=status not in shown,
            marker={"color": color, "symbol": symbol, "size": 13,
                    "line": {"width": 2, "color": color}},
            customdata=[[prow[j].get("max_abs"), prow[j].get("max_rel"),
                         prow[j].get("note") or ""] for j in pick],
            hovertemplate=("%{y}<br>max |error| = %{customdata[0]:.3g}"
                           "<br>max relative error = %{customdata[1]:.3g}"
                           "<br>%{customdata[2]}<extra></extra>"),
            meta=[{**{k: prow[j].get(k) for k in ("name", "kind", "max_abs", "max_rel")},
                   "status": status, "x": drawn[j]} for j in pick]), row=i, col=1)
        shown.add(status)
    _tolerance_ticks(fig, i, prow, labels, atol, rtol, shown)
    fig.update_yaxes(categoryorder="array", categoryarray=labels[::-1], row=i, col=1,
                     automargin=True)


def _tolerance_ticks(fig, i: int, prow: list[dict], labels: list[str], atol, rtol,
                     shown: set[str]) -> None:
    """With an rtol, each tensor has its own bar: atol + rtol * max|reference|, where
    max|reference| = max_abs / max_rel. Drawn as a tick on the tensor's row of panel i."""
    ticks = [(atol + rtol * r["max_abs"] / r["max_rel"], y) for r, y in zip(prow, labels,
                                                                           strict=True)
             if atol and rtol and _finite_pos(r.get("max_abs")) and
             _finite_pos(r.get("max_rel"))]
    if not ticks:
        return
    fig.add_trace(go.Scatter(
        x=[t for t, _ in ticks], y=[y for _, y in ticks], mode="markers",
        name="this tensor's tolerance", legendgroup="tick",
        showlegend="tick" not in shown, hovertemplate="tolerance %{x:.3g}<extra></extra>",
        marker={"symbol": "line-ns-open", "size": 16, "color": BAD_COLOR,
                "line": {"width": 2, "color": BAD_COLOR}}), row=i, col=1)
    shown.add("tick")
