"""The live view of `tplab.train_check`: the figure redrawn while the ranks train.

Each rank prints one line per step (tplab/rank/train_step.py: a marker, then JSON with the
step, its loss and its largest parameter difference from the reference). The lab reads the
ranks' output files while a cell runs (tplab/lab/streams.py); lines with the marker go to
`LiveTraining.take` instead of the cell's output. The view is an ipywidgets Output whose
`outputs` are set to the figure (at most every REDRAW_S): the way tplab's explorers redraw
a plotly figure in JupyterLab while a cell runs (a display updated by id is not redrawn by
JupyterLab's plotly renderer; plotly's FigureWidget needs anywidget, which the lab does not
install). The reference's loss curve is drawn at once, the noise band as soon as its run
(in a thread of the notebook while the ranks train) is done: the ranks' curves grow over
them. At the end the exact rows (with the replica spread, which needs
every rank's copies) replace the live ones.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import ipywidgets as w
from IPython.display import display

from tplab.checks.train_report import training_figure
from tplab.lab import streams
from tplab.lab.contract import Ranks
from tplab.rank.train_step import LIVE_PREFIX, LIVE_SUFFIX

REDRAW_S = 1.0


def live_default(lab: Ranks) -> bool:
    """Live in a Jupyter kernel with rank processes (a Simulation runs in this process: its
    figure comes at the end)."""
    return streams.in_kernel() and not lab.in_process


class LiveTraining:
    """Rows filled in as the ranks' lines arrive, and the figure redrawn from them."""

    def __init__(self, world_size: int, ref_losses, band, widget: bool | None = None):
        """`band`: noise_band's dict, or a Future of it (the band's run goes on while the
        ranks train: its curve is drawn once it is measured)."""
        self.world_size = world_size
        self.rows = [{"step": i + 1, "ref_loss": float(v), "losses": [None] * world_size,
                      "param_diff": 0.0, "param_band": math.nan,
                      "replica_spread": None, "param": ""}
                     for i, v in enumerate(ref_losses.tolist())]
        self._band = band if hasattr(band, "done") else None
        if self._band is None:
            self._set_band(band)
        self.seen = 0  # the last step every rank has reported
        self.updates = 0  # figure redraws (a test counts them)
        self.figure = training_figure(self._drawn(), world_size)
        self._drawn_at = -math.inf
        self._bundle = None
        self.output = None
        if streams.in_kernel() if widget is None else widget:
            self.output = w.Output()
            display(self.output)
            self._show()

    def _set_band(self, band: dict) -> None:
        for i, row in enumerate(self.rows):
            row["param_band"] = band["param"][i + 1]

    def _drawn(self) -> list[dict]:
        return [r if r["step"] <= self.seen else {**r, "param_band": r["param_band"],
                                                  "param_diff": math.nan}
                for r in self.rows]

    def take(self, rank: int, line: str) -> None:
        """A rank's line (the handler registered while the ranks train)."""
        text = line[line.index(LIVE_PREFIX) + len(LIVE_PREFIX):].removesuffix(LIVE_SUFFIX)
        try:
            record = json.loads(text)
        except ValueError:
            return
        i = record["step"] - 1
        if not 0 <= i < len(self.rows):
            return
        row = self.rows[i]
        row["losses"][rank] = record["loss"]
        row["param_diff"] = max(row["param_diff"], record["diff"])
        if all(v is not None for v in row["losses"]):
            self.seen = max(self.seen, i + 1)
        now = time.monotonic()
        if now - self._drawn_at >= REDRAW_S:
            self.redraw(now)

    def redraw(self, now: float | None = None) -> None:
        """Refill the figure's data from the rows so far. The figure's JSON is written
        directly (plotly's validation of every list, redone at each redraw, cost about
        0.3 s a redraw here: benchmarks/train_check.py)."""
        self._drawn_at = time.monotonic() if now is None else now
        if self._band is not None and self._band.done() and self._band.exception() is None:
            self._set_band(self._band.result())
            self._band = None
        shown = self.rows[:max(self.seen, 1)]
        steps = [r["step"] for r in shown]
        # A new bundle, its traces new dicts: the Output widget's `outputs` trait sends a
        # change to the page only when the new value differs (traitlets compares old == new);
        # the same dicts refilled in place compare equal to themselves, and nothing is sent.
        old = self.bundle()
        figure = old["application/vnd.plotly.v1+json"]
        data = [dict(trace) for trace in figure["data"]]
        self._bundle = {**old, "application/vnd.plotly.v1+json": {**figure, "data": data}}
        data[0]["x"], data[0]["y"] = [r["step"] for r in self.rows], \
            [r["ref_loss"] for r in self.rows]
        for k in range(self.world_size):
            data[1 + k]["x"], data[1 + k]["y"] = steps, [r["losses"][k] for r in shown]
        n = 1 + self.world_size
        data[n]["x"], data[n]["y"] = steps, [None if math.isnan(r["param_band"])
                                             else r["param_band"] for r in shown]  # JSON
        data[n + 1]["x"], data[n + 1]["y"] = steps, [max(r["param_diff"], 1e-12)
                                                     for r in shown]
        self.updates += 1
        self._show()

    def bundle(self) -> dict:
        """The figure as the mime bundle the Output widget shows (a new one at each redraw)."""
        if self._bundle is None:
            figure = json.loads(self.figure.to_json())  # plain lists and dicts
            self._bundle = {"text/plain": "<training figure>",
                            "application/vnd.plotly.v1+json": {**figure, "config": {}}}
        return self._bundle

    def _show(self) -> None:
        if self.output is None:
            return
        self.output.outputs = ({"output_type": "display_data", "data": self.bundle(),
                                "metadata": {}},)

    @contextlib.contextmanager
    def listening(self):
        """While the ranks train: the marker's lines come here."""
        streams.LINE_HANDLERS[LIVE_PREFIX] = self.take
        try:
            yield self
        finally:
            streams.LINE_HANDLERS.pop(LIVE_PREFIX, None)

    def finish(self, report) -> None:
        """The exact rows of the report, in place of the live ones."""
        training_figure(report.rows, self.world_size, report.first_bad_step, report.detail,
                        fig=self.figure)
        self._bundle = None  # the exact figure, validated once
        self.seen = len(self.rows)
        self.updates += 1
        self._show()
