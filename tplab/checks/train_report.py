"""The training report: one row per step, the noise band, and what diverged first.

A row is a `TrainRow` (a frozen record, read by key as the dicts it replaced: `row["ok"]`;
step i = the i-th optimizer step; its loss is the one computed in step i, its parameters
are the ones after it): step, ref_loss, losses (one per rank), loss_diff, loss_band,
param_diff, param (the parameter furthest from the reference), param_band,
replica_spread, spread_param, by_kind ({"sharded"/"replicated": (drift, whose)}), ok.
`loss_diff` is |mean of the dp replicas' losses - the reference's| (the largest over the
tp ranks of a replica); `param_diff` the largest |parameter - reference| over every
parameter, its pieces on the ranks paired as grad_check pairs them; `replica_spread` the
largest difference between copies of a parameter that every rank (or replica) should hold
alike. A step is ok when the three are within their bands (`tplab.checks.train_band`).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tplab.core.records import Record
from tplab.viz.palette import BAD_COLOR, EXACT_COLOR, rank_color, style

KINDS = ("loss", "sharded", "replicated")
WORDS = {"loss": "the loss", "sharded": "a sharded parameter",
         "replicated": "a replicated parameter"}


@dataclass(frozen=True)
class TrainRow(Record):
    """One step of a training report (see the module doc)."""

    step: int
    param_diff: float
    param: str
    param_band: float
    replica_spread: float
    spread_param: str
    by_kind: dict
    ref_loss: float
    losses: list
    loss_diff: float
    loss_band: float
    ok: bool


@dataclass
class TrainReport:
    """`ok`, `first_bad_step` (None when ok), `rows` (one per step), `diverged` (what was
    outside the band at the first bad step: "loss", "sharded", "replicated", worst first),
    `detail` (a sentence saying it), `noise` (how the band was measured), `figure()`."""

    rows: list[TrainRow]
    world_size: int
    mesh_shape: dict
    first_bad_step: int | None = None
    diverged: list[str] = field(default_factory=list)
    detail: str = ""
    noise: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.first_bad_step is None

    def figure(self) -> go.Figure:
        """Loss curves (reference and ranks) and the drift from the reference against the
        noise band, on a log scale."""
        return training_figure(self.rows, self.world_size, self.first_bad_step, self.detail)

    def summary(self) -> str:
        dims = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        steps = len(self.rows)
        if self.ok:
            worst = max((r["param_diff"] / r["param_band"] for r in self.rows
                         if r["param_band"] > 0), default=0.0)
            return (f"train_check passed: {steps} steps on {self.world_size} ranks ({dims}) "
                    f"stay within the noise band (largest drift {worst:.2g} x the band)")
        return (f"train_check FAILED at step {self.first_bad_step} of {steps} "
                f"({self.world_size} ranks, {dims}): {self.detail}")

    def __str__(self) -> str:
        lines = [self.summary(), self.noise]
        lines += [f"note: {n}" for n in self.notes]
        head = f"{'step':>5} {'ref loss':>10} {'loss diff':>10} {'band':>9} " \
               f"{'param diff':>10} {'band':>9} {'spread':>9}  param"
        lines.append(head)
        for r in _shown(self.rows, self.first_bad_step):
            if r is None:
                lines.append("  ...")
                continue
            mark = "" if r["ok"] else "  <- outside the band"
            lines.append(f"{r['step']:>5} {r['ref_loss']:>10.5f} {r['loss_diff']:>10.2e} "
                         f"{r['loss_band']:>9.1e} {r['param_diff']:>10.2e} "
                         f"{r['param_band']:>9.1e} {r['replica_spread']:>9.1e}  "
                         f"{r['param']}{mark}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        color = "#2e7d32" if self.ok else BAD_COLOR
        return (f'<div style="color:{color}"><b>{html.escape(self.summary())}</b></div>'
                f"<pre>{html.escape(str(self).split(chr(10), 1)[1])}</pre>")


def _shown(rows, bad, edge: int = 3) -> list:
    """The first and last steps, and those around the first bad one."""
    keep = set(range(min(edge, len(rows)))) | set(range(max(0, len(rows) - edge), len(rows)))
    if bad is not None:
        keep |= set(range(max(0, bad - 2), min(len(rows), bad + 2)))
    out, last = [], -1
    for i in sorted(keep):
        if i != last + 1:
            out.append(None)
        out.append(rows[i])
        last = i
    return out


def training_figure(rows: list[dict], world_size: int, bad: int | None = None,
                    detail: str = "", fig: go.Figure | None = None) -> go.Figure:
    """Two panels: the loss of every rank over the reference's, and the drift (parameter
    difference, replica spread) over the noise band. `fig`: a figure made by this function
    to refill in place (the live view)."""
    steps = [r["step"] for r in rows]
    fresh = fig is None
    if fresh:
        fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                            subplot_titles=("loss", "drift from one device"))
        fig.add_scatter(x=[], y=[], name="one device", line={"color": EXACT_COLOR, "width": 4},
                        row=1, col=1)
        for r in range(world_size):
            fig.add_scatter(x=[], y=[], name=f"rank {r}", mode="lines",
                            line={"color": rank_color(r), "width": 1.5}, row=1, col=1)
        fig.add_scatter(x=[], y=[], name="noise band (parameters)", fill="tozeroy",
                        line={"color": "#bdbdbd"}, row=1, col=2)
        fig.add_scatter(x=[], y=[], name="parameter difference", line={"color": "#1f4e9c"},
                        row=1, col=2)
        fig.add_scatter(x=[], y=[], name="replica spread", line={"color": BAD_COLOR,
                                                                 "dash": "dot"}, row=1, col=2)
        fig.update_yaxes(type="log", row=1, col=2, exponentformat="e")
        fig.update_xaxes(title_text="step")
        style(fig, "Training against one device", "loss curves, and the drift against the "
              "noise of another reduction order", height=380)
    floor = 1e-12  # log axes: a difference of exactly 0 is drawn at the floor
    with fig.batch_update():
        fig.data[0].update(x=steps, y=[r["ref_loss"] for r in rows])
        for k in range(world_size):
            fig.data[1 + k].update(x=steps, y=[r["losses"][k] if len(r["losses"]) > k
                                               else None for r in rows])
        n = 1 + world_size
        fig.data[n].update(x=steps, y=[max(r["param_band"], floor) for r in rows])
        fig.data[n + 1].update(x=steps, y=[max(r["param_diff"], floor) for r in rows])
        fig.data[n + 2].update(x=steps, y=[_finite(r.get("replica_spread"), floor)
                                           for r in rows])
    fig.layout.shapes, fig.layout.annotations = (), fig.layout.annotations[:2]  # the titles
    if bad is not None:  # (add_vline does not work inside batch_update)
        fig.add_vline(x=bad, line={"color": BAD_COLOR, "dash": "dash"}, row=1, col=2,
                      annotation_text=f"first bad step {bad}")
    return fig


def _finite(v, floor):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return max(v, floor)


def diverged(row: dict) -> tuple[list[str], str]:
    """(what diverged at the bad step `row`, worst first: "loss", "sharded", "replicated";
    the sentence that says by how much, against which band)."""
    ratios = {}
    if row["loss_diff"] > row["loss_band"]:
        ratios["loss"] = row["loss_diff"] / max(row["loss_band"], 1e-30)
    for kind in ("sharded", "replicated"):
        if row["by_kind"][kind][0] > row["param_band"]:
            ratios[kind] = row["by_kind"][kind][0] / max(row["param_band"], 1e-30)
    kinds = sorted(ratios, key=ratios.get, reverse=True)
    if not kinds:  # cannot happen: a row is bad because something is outside its band
        kinds = ["loss"]
    parts = []
    for kind in kinds:
        if kind == "loss":
            parts.append(f"the loss differs from one device's by {row['loss_diff']:.3g} "
                         f"(band {row['loss_band']:.2g})")
        elif kind == "replicated" and row["replica_spread"] > row["param_band"]:
            parts.append(f"a replicated parameter, {row['spread_param']}, differs across "
                         f"ranks by {row['replica_spread']:.3g} (band {row['param_band']:.2g})")
        else:
            value, name = row["by_kind"][kind]
            parts.append(f"{WORDS[kind]}, {name}, drifted from one device's by {value:.3g} "
                         f"(band {row['param_band']:.2g})")
    what = WORDS[kinds[0]]
    step = row["step"]
    head = (f"{what} diverged first, at step {step}" if step else
            "the ranks' initial weights differ from the notebook's (step 0)")
    return kinds, f"{head}: " + "; ".join(parts)
