"""`CostExplorer`: change the hardware and the model's dimensions, watch where TP stops paying,
and (the memory view) from which TP degree a micro-batch fits in the GPU's memory.

Two questions, two answers in the summary: `best_tp` is the training answer (the most
tokens per second per GPU: `best_tp(rows)`, objective "throughput"), `fits_tp` the same
within the GPU's usable memory, and `fastest_tp` the latency answer (the shortest
micro-batch, objective "latency": serving, or a fixed group of GPUs). The sweep runs the
TP degrees the model's heads allow (`allowed_tps`).

The whole-run controls (GPUs, global batch, PP, CP, sharding) price a whole training run at
each TP degree with `cost.predict` (`tplab.cost.training_run`): `runs` maps each TP degree
to its `Prediction` (or the rule that refuses it), and `run_tp` is the degree that trains
the most tokens per second per GPU among the runs that fit in memory.

The widgets only set values; `update(**values)` does the same from code, so a notebook run
by papermill drives the explorer (and asserts on `rows`) without anyone clicking. The figure
lives in an ipywidgets Output whose `outputs` are set directly (as the Explorer's are): not
`with out: display(...)`, whose capture made nbclient (papermill) wait out its timeout now
and then, and not a display id updated in place, which JupyterLab's plotly renderer never
redrew (the summary changed, the figure did not).
"""

from __future__ import annotations

import json
import math

import ipywidgets as w
from IPython.display import display

from tplab.cost.figures import memory_bars, step_breakdown
from tplab.cost.hardware import HARDWARE, Hardware
from tplab.cost.shapes import MODELS, BlockShape, scaled
from tplab.cost.step import best_tp, comm_bound_tp, sweep
from tplab.cost.training_run import SHARDINGS, TrainingRun, predict
from tplab.cost.transformer import allowed_tps
from tplab.cost.validate import check_bool, check_int

TPS = (1, 2, 4, 8, 16, 32, 64)
# the dropdowns of sizes, where code may set a size they do not list yet (hidden=3072)
NUMBERS = ("hidden", "seq", "gpus_per_node", "gpus", "global_batch", "pp", "cp")


class CostExplorer:
    """Dropdowns for model and hardware; hidden size, sequence length, micro-batch, GPUs per
    node and sequence parallelism as controls. `rows` are the current `sweep` rows."""

    def __init__(self, models: dict[str, BlockShape] = MODELS,
                 hardware: dict[str, Hardware] = HARDWARE, tps=TPS,
                 model: str = "Llama-3 70B", hw: str = "H100 SXM"):
        self.models, self.hardware, self.tps = dict(models), dict(hardware), tuple(tps)
        style = {"description_width": "9em"}
        self.controls = {
            "model": w.Dropdown(options=list(self.models), value=model, description="model",
                                style=style),
            "hardware": w.Dropdown(options=list(self.hardware), value=hw,
                                   description="hardware", style=style),
            "hidden": w.Dropdown(options=[1024, 2048, 4096, 8192, 12288, 16384],
                                 description="hidden size", style=style),
            "seq": w.Dropdown(options=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                              description="sequence", style=style),
            "batch": w.BoundedIntText(min=1, max=64, description="micro-batch", style=style),
            "gpus_per_node": w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 72],
                                        description="GPUs per node", style=style),
            "sequence_parallel": w.Checkbox(description="sequence parallel"),
            "recompute": w.Dropdown(options=["none", "selective", "full"],
                                    description="recomputation", style=style),
            "precision": w.Dropdown(options=["mixed", "bf16", "fp32"],
                                    description="precision", style=style),
            "layout": w.Dropdown(options=[("tplab's block", "tplab"),
                                          ("the paper's GPT layer", "gpt")],
                                 description="activations", style=style),
            "gpus": w.Dropdown(options=[8, 64, 256, 512, 1024, 2048, 4096, 8192, 16384],
                               value=512, description="GPUs (run)", style=style),
            "global_batch": w.Dropdown(options=[64, 256, 512, 1024, 2048, 4096], value=1024,
                                       description="global batch", style=style),
            "pp": w.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="PP",
                             style=style),
            "cp": w.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="CP",
                             style=style),
            "sharding": w.Dropdown(options=list(SHARDINGS), value="zero1",
                                   description="sharding", style=style),
        }
        self.summary = w.HTML()
        self.figure = None          # the plotly figure of the current rows
        self.memory_figure = None   # their memory per GPU
        self.figure_output = w.Output()  # where each is drawn (redrawn on every change)
        self.memory_output = w.Output()
        self._updating = False
        self._preset(model, hw)
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        boxes = list(self.controls.values())
        self.widget = w.VBox([w.HBox([w.VBox(boxes[:5]), w.VBox(boxes[5:10]),
                                      w.VBox(boxes[10:])]),
                              self.summary, self.figure_output, self.memory_output])
        self.update()

    def _preset(self, model: str, hw: str) -> None:
        """Set the dimension controls from a model preset and the node size from hardware."""
        shape = self.models[model]
        for name, value in (("hidden", shape.hidden), ("seq", shape.seq),
                            ("batch", shape.batch),
                            ("gpus_per_node", self.hardware[hw].gpus_per_node)):
            self._set(name, value)

    def _set(self, name: str, value) -> None:
        """Set a control, adding a number a dropdown does not offer yet (hidden=3072)."""
        control = self.controls[name]
        if name in ("model", "hardware") and value not in control.options:
            raise ValueError(f"no {name} named {value!r}; have {list(control.options)}")
        if name in NUMBERS and value not in control.options:
            control.options = sorted({*control.options, value})
        control.value = value

    def _check(self, name: str, value) -> None:
        """A value from code, as the control could hold it: the widget would clamp an
        out-of-range number (batch=128 priced as 64) or fail deep inside on a string, so a
        wrong type or range is an error naming the control and what it takes."""
        control = self.controls[name]
        if isinstance(control, w.Checkbox):
            check_bool(name, value)
        elif isinstance(control, w.BoundedIntText):
            check_int(name, value, minimum=-math.inf)   # its type; the range below
            if not control.min <= value <= control.max:
                raise ValueError(f"{name} must be from {control.min} to {control.max} (the "
                                 f"control's range), got {value}")
        elif name in NUMBERS:   # a dropdown of sizes: another whole number is added to it
            check_int(name, value)
        elif name not in ("model", "hardware"):
            allowed = [o[1] if isinstance(o, tuple) else o for o in control.options]
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    def _value(self, name: str):
        return self.controls[name].value

    def _on_change(self, change) -> None:
        if self._updating:
            return
        c = self.controls
        self._updating = True
        if change["owner"] is c["model"]:
            self._preset(change["new"], c["hardware"].value)
        if change["owner"] is c["hardware"]:
            self._set("gpus_per_node", self.hardware[change["new"]].gpus_per_node)
        self._updating = False
        self.update()

    def update(self, **values) -> list[dict]:
        """Set any controls by name (e.g. `hardware="A100 SXM", hidden=4096`), redraw, and
        return the new rows."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise ValueError(f"no control named {sorted(unknown)}; have {list(self.controls)}")
        for name, value in values.items():
            self._check(name, value)
        self._updating = True
        try:
            if "model" in values:   # a preset first, so that explicit values win over it
                self._set("model", values["model"])
                self._preset(values["model"], values.get("hardware", self._value("hardware")))
            if "hardware" in values:
                self._set("hardware", values["hardware"])
                self._set("gpus_per_node", self.hardware[values["hardware"]].gpus_per_node)
            for name, value in values.items():
                self._set(name, value)
        finally:
            self._updating = False
        v = {name: c.value for name, c in self.controls.items()}
        self.shape, self.hw = self._scaled(v), self.hardware[v["hardware"]].with_(
            gpus_per_node=v["gpus_per_node"])
        tps = allowed_tps(self.shape, self.tps) or (1,)
        self.rows = sweep(self.shape, self.hw, tps, sequence_parallel=v["sequence_parallel"],
                          recompute=v["recompute"], precision=v["precision"],
                          layout=v["layout"])
        self.best_tp = best_tp(self.rows)                        # throughput: training
        self.fastest_tp = best_tp(self.rows, "latency")          # latency: serving
        self.fits_tp = best_tp(self.rows, memory_limit=self.hw.usable_memory)  # None: no fit
        self.comm_bound_tp = comm_bound_tp(self.shape, self.hw)
        self.runs = self._runs(v, tps)
        fitting = [(tp, p) for tp, p in self.runs.items() if not isinstance(p, str) and p.fits]
        self.run_tp = min(fitting, key=lambda tp_p: (-tp_p[1].tokens_per_s_per_gpu,
                                                     tp_p[0]))[0] if fitting else None
        self._draw()
        return self.rows

    def _runs(self, v: dict, tps) -> dict:
        """{tp: Prediction, or the rule that refuses the run} at the whole-run controls."""
        out = {}
        for tp in tps:
            try:
                out[tp] = predict(TrainingRun(
                    self.shape, self.hw, v["gpus"], tp=tp, pp=v["pp"], cp=v["cp"],
                    micro_batch=v["batch"], global_batch=v["global_batch"], seq_len=v["seq"],
                    recompute=v["recompute"], sharding=v["sharding"]))
            except ValueError as e:
                out[tp] = str(e)
        return out

    def _run_summary(self) -> str:
        v = {name: c.value for name, c in self.controls.items()}
        head = (f" Whole run ({v['gpus']} GPUs, global batch {v['global_batch']}, PP "
                f"{v['pp']}, CP {v['cp']}, {v['sharding']}): ")
        if self.run_tp is None:
            return head + "<b>no TP degree fits or is valid</b>."
        p = self.runs[self.run_tp]
        return head + (f"<b>TP {self.run_tp}</b>, {p.tokens_per_s_per_gpu:,.0f} tokens/s "
                       f"per GPU, MFU {p.mfu:.2f} end to end, {p.memory_per_gpu / 1e9:.0f} "
                       "GB per GPU.")

    def _scaled(self, v: dict) -> BlockShape:
        base = self.models[v["model"]]
        return scaled(base, v["hidden"], seq=v["seq"], batch=v["batch"],
                      name=f"{base.name}, h={v['hidden']}, s={v['seq']}, b={v['batch']}")

    def _draw(self) -> None:
        fast = next(r for r in self.rows if r["tp"] == self.fastest_tp)
        bound = self.comm_bound_tp
        usable = self.hw.usable_memory
        self.summary.value = (
            f"<b>{self.hw.name}</b>, {self.hw.gpus_per_node} GPUs per node. Training (most "
            f"tokens/s per GPU) within {usable / 1e9:.0f} GB usable of "
            f"{self.hw.memory / 1e9:.0f} GB per GPU: "
            + (f"<b>TP {self.fits_tp}</b>" if self.fits_tp else
               f"<b>nothing fits</b> up to TP {self.rows[-1]['tp']}")
            + f". Shortest micro-batch (latency): <b>TP {self.fastest_tp}</b> "
            f"({fast['step_s'] * 1e3:.1f} ms, {fast['comm_fraction']:.0%} communication); "
            f"communication-bound from <b>TP {bound if bound else '> 1024'}</b>."
            + self._run_summary() + " Model only: not measured on a GPU here.")
        self.figure = step_breakdown({self.shape.name: self.rows}, title=f"{self.hw.name}")
        self.memory_figure = memory_bars(self.rows, f"Memory per GPU, {self.hw.name}",
                                         self.shape.name, memory=self.hw.usable_memory)
        self.figure_output.outputs = (
            {"output_type": "display_data", "data": self._bundle(), "metadata": {}},)
        self.memory_output.outputs = (
            {"output_type": "display_data", "data": self._bundle(self.memory_figure),
             "metadata": {}},)

    def _bundle(self, figure=None) -> dict:
        # a raw mime bundle: what the Output widget holds (and what the notebook file keeps)
        figure = self.figure if figure is None else figure
        return {"application/vnd.plotly.v1+json": json.loads(figure.to_json()),
                "text/plain": f"<figure: {self.shape.name} on {self.hw.name}>"}

    def _ipython_display_(self) -> None:
        display(self.widget)
