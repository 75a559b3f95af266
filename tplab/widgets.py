"""The Explorer's panel (ipywidgets): controls, status, figures and the report's table.

It only displays: the Explorer itself (tplab/checks/explorer.py: `from tplab.checks.explorer
import Explorer`) runs the step on the ranks and judges it, and this panel calls its `set`,
`update` and `_checked`, and draws its `report` and `figures`.
"""

from __future__ import annotations

import dataclasses
import html
import math
from dataclasses import asdict

import ipywidgets as w
import torch
from IPython import get_ipython
from IPython.display import display

__all__ = ["ExplorerPanel", "divisors", "forward_order", "tolerance"]


def forward_order(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """Leaf modules in the order a forward pass calls them (what `grad_flow` draws)."""
    names: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: names.append(n) if n not in names
                                         else None)
             for n, m in model.named_modules() if n and not any(m.children())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return names


def tolerance(name: str, value) -> float:
    """grad_check's tolerance `name` as a finite number >= 0 (a negative one fails every
    gradient, inf passes any, nan none)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number such as 1e-5, not {type(value).__name__} "
                        f"{value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
    return float(value)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (d > 1 or n == 1)]


class ExplorerPanel:
    """The panel of an Explorer (tplab/checks/explorer.py): built on first display. Reads
    the Explorer's `settings`, `world_size`, `report` and `figures`; a control change
    calls its `_checked` and `update`."""

    _ui = None
    _quiet = False

    # --- the panel --------------------------------------------------------------------

    @property
    def widget(self):
        """The ipywidgets panel (built on first use)."""
        if self._ui is None:
            self._ui = self._build_ui()
            self._sync_controls()
            self._redraw()
        return self._ui["panel"]

    def _ipython_display_(self):
        display(self.widget)

    def _build_ui(self) -> dict:
        style = {"description_width": "initial"}
        ui = {
            "model": w.Dropdown(options=[("MLP", "mlp"), ("attention", "attention"),
                                         ("block", "block")], description="model",
                                style=style),
            "tp": w.Dropdown(options=divisors(self.world_size), description="TP degree",
                             style=style),
            "path": w.ToggleButtons(options=[("Megatron by hand", "megatron"),
                                             ("DTensor plan", "dtensor")], style=style),
            "sequence_parallel": w.Checkbox(description="sequence parallelism", indent=False),
            "drop_f": w.Checkbox(description="drop f's backward all-reduce", indent=False),
            "status": w.HTML(),
            "table": w.HTML(layout=w.Layout(max_height="260px", overflow="auto")),
        }
        for name in ("flow", "errors", "timeline", "sharding"):
            ui[name] = w.Output()
        for name in self._controls():
            ui[name].observe(self._on_control, names="value")
        ui["panel"] = w.VBox([
            w.HBox([ui["model"], ui["tp"], ui["path"]]),
            w.HBox([ui["sequence_parallel"], ui["drop_f"]]),
            ui["status"], ui["flow"], ui["errors"], ui["table"], ui["timeline"],
            ui["sharding"]])
        return ui

    def _controls(self) -> list[str]:
        """The settings a control shows, one control each."""
        return [f.name for f in dataclasses.fields(self.settings)]

    def _on_control(self, change) -> None:
        if self._quiet:
            return
        values = {k: self._ui[k].value for k in self._controls()}
        if values["path"] != "megatron":
            values["drop_f"] = False
        try:
            self.settings = self._checked(dataclasses.replace(self.settings, **values))
        except ValueError as exc:
            self._status(str(exc), "#c62828")
            return
        self._sync_controls()
        self.update()

    def _sync_controls(self) -> None:
        if self._ui is None:
            return
        self._quiet = True
        try:
            for k, v in asdict(self.settings).items():
                self._ui[k].value = v
            self._ui["drop_f"].disabled = self.settings.path != "megatron"
            self._ui["drop_f"].tooltip = (
                None if self.settings.path == "megatron" else
                "a DTensor plan issues f's all-reduce itself: nothing to drop")
        finally:
            self._quiet = False

    def _status(self, text: str, color: str, pre: bool = False) -> None:
        if self._ui is None:
            return
        body = html.escape(text)
        body = f"<pre>{body}</pre>" if pre else f"<b>{body}</b>"
        self._ui["status"].value = f'<div style="color:{color}">{body}</div>'

    def _redraw(self) -> None:
        if self._ui is None:
            return
        shell = get_ipython()
        for name in ("flow", "errors", "timeline", "sharding"):
            outputs = ()
            if name in self.figures and shell is not None:
                # Set the Output widget's outputs, rather than `with out: display(fig)`:
                # that relies on a frontend capturing messages, and under papermill
                # (nbclient 0.11) it stalled each cell until the execution timeout.
                # (not display_formatter.format: it would call the figure's
                # _ipython_display_, which shows it in the cell instead)
                data = {"text/plain": f"<{name} figure>",
                        **self.figures[name]._repr_mimebundle_()}
                outputs = ({"output_type": "display_data", "data": data, "metadata": {}},)
            self._ui[name].outputs = outputs
        self._ui["table"].value = self.report._repr_html_() if self.report else ""
