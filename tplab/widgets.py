"""The Explorer: an ipywidgets panel that reruns one TP step whenever a control changes.

    ex = tplab.widgets.Explorer(lab)            # a Lab or a tplab.simulate(...)
    ex                                          # shows the panel in Jupyter
    ex.set(model="block", sequence_parallel=True)   # the same from code: runs synchronously
    ex.report.ok, ex.trace, ex.figures["flow"]      # the latest results, for asserts

Controls: the model (MLP, attention, block), the TP degree, the hand-written Megatron
path (`tplab.megatron.parallelize`) or a DTensor plan (`tplab.plans`), sequence
parallelism, and "drop f's backward all-reduce". Each change runs ONE step on the ranks:
build the model with the notebook's weights, parallelise, forward and backward under
`tplab.trace()`, and bring back the trace, the parameters' shards and the gradients. The
notebook then compares them with the single-device model (as `tplab.grad_check` does) and
redraws the figures of `tplab.viz` and the grad_check table.

TP degree: any divisor of the world size. Below the world size the ranks form a 2-D mesh
`make_mesh(dp=world // tp, tp=tp)`: each dp group runs the same TP step on the same input,
so their shards show up as copies (hatched) in the sharding map, and every collective of
the trace is on a tp group. "Drop f" exists only on the hand-written path: a DTensor plan
issues f's all-reduce itself (in the backward of `DTensor.from_local`), so the box is
disabled there.

Nothing here blocks: no threads, no event loop. A control's callback runs the step and
returns; in papermill nobody clicks, and `set()` is how a notebook drives the panel.
"""

from __future__ import annotations

import html
import math
from dataclasses import asdict, replace

import ipywidgets as w
import torch
from IPython import get_ipython
from IPython.display import display

from tplab import models
from tplab.checks.grad import tensor_rows
from tplab.checks.grad_report import GradCheckReport
from tplab.rank.explore_step import MODELS, PATHS, Settings, build_model, explore_step
from tplab.viz import comm_timeline, forward_stages, grad_error, grad_flow, sharding_map

__all__ = ["Explorer", "Settings", "divisors", "forward_order"]


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


class Explorer:
    """A panel of controls over one TP step; see the module docstring.

    After every step: `report` (a grad_check report), `trace` (per-rank records),
    `params` (name -> per-rank LocalShard), `figures` (flow, timeline, sharding, errors),
    `settings`, and `error` (the exception of a failed step, else None).
    """

    def __init__(self, lab, *, config=None, atol: float = 1e-5, rtol: float = 1e-4,
                 **settings):
        self.lab = lab
        self.world_size = lab.world_size
        self.config = config or models.Config()
        self.atol, self.rtol = tolerance("atol", atol), tolerance("rtol", rtol)
        self.settings = self._checked(replace(Settings(), **settings))
        self.report = self.trace = self.params = self.error = None
        self.figures: dict = {}
        self._ui = None
        self._quiet = False
        self.update(raise_errors=True)

    # --- driving it from code ---------------------------------------------------------

    def set(self, **changes) -> Explorer:
        """Change settings (model, tp, path, sequence_parallel, drop_f), rerun, redraw.

        Synchronous; raises what the step raised (the panel shows it instead). Settings
        equal to the last successful step's do not rerun it (`update()` always does)."""
        new = self._checked(replace(self.settings, **changes))
        if new == self.settings and self.error is None and self.report is not None:
            return self
        self.settings = new
        self._sync_controls()
        self.update(raise_errors=True)
        return self

    def _checked(self, s: Settings) -> Settings:
        if s.tp is None or (type(s.tp) is int and s.tp == 0):
            s = replace(s, tp=self.world_size)
        self._checked_tp(s.tp)
        for name in ("sequence_parallel", "drop_f"):
            if not isinstance(getattr(s, name), bool):
                raise TypeError(f"{name} must be True or False, not {getattr(s, name)!r}")
        if s.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, not {s.model!r}")
        if s.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, not {s.path!r}")
        if s.drop_f and s.path != "megatron":
            raise ValueError("drop_f needs path='megatron': a DTensor plan issues f's "
                             "all-reduce itself, there is no f to drop")
        return s

    def _checked_tp(self, tp) -> None:
        """A TP degree the panel can show: a divisor of the world size above 1 (tp = 1
        splits nothing, so nothing would be drawn), as an int."""
        world, allowed = self.world_size, divisors(self.world_size)
        if isinstance(tp, bool) or not isinstance(tp, int):
            raise TypeError(f"tp must be an int, one of {allowed}; got {type(tp).__name__} "
                            f"{tp!r}")
        if tp == 1 and world > 1:
            raise ValueError(f"tp = 1 splits nothing, so the Explorer has no TP to show: tp "
                             f"is a divisor of the world size {world} above 1, one of "
                             f"{allowed}")
        if tp not in allowed:
            raise ValueError(f"tp must divide the world size {world}: one of {allowed}, "
                             f"not {tp}")

    # --- one step ---------------------------------------------------------------------

    def update(self, raise_errors: bool = False) -> None:
        """Run the step on the ranks, check it against one device, redraw."""
        s = self.settings
        self._status(f"running {self._describe()} ...", "#616161")
        try:
            ref = build_model(s.model, self.config)
            state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
            x = models.make_input(self.config)
            order = forward_stages(ref, x)  # forward order, q/k/v and w1/w3 as branches
            x_ref = x.clone().requires_grad_(True)
            out = ref(x_ref)
            loss = 0.5 * out.pow(2).sum()
            loss.backward()
            results = self.lab.run(explore_step, s.model, self.config, state, x, s)
            self.report = self._report(results, ref, out, loss, x_ref)
            self.trace = [r.records for r in results]
            self.params = {k: [r.params[k] for r in results] for k in results[0].params}
            self.figures = self._figures(order)
            self.error = None
        except Exception as exc:
            self.error = exc
            self.report = self.trace = self.params = None
            self.figures = {}
            self._redraw()
            self._status(f"{self._describe()} failed: {type(exc).__name__}: {exc}", "#c62828",
                         pre=True)
            if raise_errors:
                raise
            return
        verdict = ("matches the single-device model" if self.report.ok
                   else f"WRONG: {len(self.report.failures)} tensor(s) off")
        self._status(f"{self._describe()}: {verdict}",
                     "#2e7d32" if self.report.ok else "#c62828")
        self._redraw()

    def _describe(self) -> str:
        s = self.settings
        mesh = (f"tp={s.tp}" if s.tp == self.world_size
                else f"dp={self.world_size // s.tp} × tp={s.tp}")
        bits = [s.model, mesh, "Megatron by hand" if s.path == "megatron" else "DTensor plan"]
        bits += ["sequence parallel"] * s.sequence_parallel
        if s.drop_f:  # under SP an all-gather takes f's place: there is no f to break
            bits.append("f without all-reduce" + " (no f under SP)" * s.sequence_parallel)
        return ", ".join(bits)

    def _report(self, results, ref, out, loss, x_ref):
        rows = []

        def add(name, kind, values, reference):  # as grad_check reports each tensor
            rows.extend(tensor_rows(name, kind, values, reference, self.atol, self.rtol))

        add("output", "output", [r.output for r in results], out)
        add("loss", "output", [r.loss.reshape(1) for r in results], loss.reshape(1))
        add("input", "input_grad", [r.input_grad for r in results], x_ref.grad)
        for name, p in ref.named_parameters():
            add(name, "param_grad", [r.grads.get(name) for r in results], p.grad)
        return GradCheckReport(rows, len(results), self.atol, self.rtol, loss.item())

    def _figures(self, order: list) -> dict:
        what = self._describe()
        return {
            "flow": grad_flow(self.trace, order, title=f"Where the collectives sit: {what}"),
            "timeline": comm_timeline(self.trace, title=f"Collectives per rank: {what}"),
            "errors": grad_error(self.report, title=f"Errors against one device: {what}"),
            "sharding": sharding_map(self.params, title=f"Parameters' shards: {what}"),
        }

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
        for name in Settings.__dataclass_fields__:
            ui[name].observe(self._on_control, names="value")
        ui["panel"] = w.VBox([
            w.HBox([ui["model"], ui["tp"], ui["path"]]),
            w.HBox([ui["sequence_parallel"], ui["drop_f"]]),
            ui["status"], ui["flow"], ui["errors"], ui["table"], ui["timeline"],
            ui["sharding"]])
        return ui

    def _on_control(self, change) -> None:
        if self._quiet:
            return
        values = {k: self._ui[k].value for k in Settings.__dataclass_fields__}
        if values["path"] != "megatron":
            values["drop_f"] = False
        try:
            self.settings = self._checked(Settings(**values))
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
