"""The Explorer: one TP step rerun whenever a control changes, checked against one device.

    ex = Explorer(lab)                          # a Lab or a tplab.simulate(...)
    ex                                          # shows the panel in Jupyter
    ex.set(model="block", sequence_parallel=True)   # the same from code: runs synchronously
    ex.report.ok, ex.trace, ex.figures["flow"]      # the latest results, for asserts

Controls: the model (MLP, attention, block), the TP degree, the hand-written Megatron
path (`tplab.megatron.parallelize`) or a DTensor plan (`tplab.plans`), sequence
parallelism, and "drop f's backward all-reduce". Each change runs ONE step on the ranks
(tplab/rank/explore_step.py): build the model with the notebook's weights, parallelise,
forward and backward under `tplab.trace()`, and bring back the trace, the parameters'
shards and the gradients. Here they are compared with the single-device model (as
`tplab.grad_check` compares them: `explore_check`), and the panel (tplab/widgets.py, which
only displays) redraws the figures of `tplab.viz` and the grad_check table.

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

from dataclasses import dataclass, replace

from tplab import models
from tplab.checks.grad import tensor_rows
from tplab.checks.grad_report import GradCheckReport
from tplab.rank.explore_step import MODELS, PATHS, Settings, build_model, explore_step
from tplab.viz import comm_timeline, forward_stages, grad_error, grad_flow, sharding_map
from tplab.widgets import ExplorerPanel, divisors, tolerance

__all__ = ["Exploration", "Explorer", "Settings", "explore_check"]


@dataclass(frozen=True, eq=False)
class Exploration:
    """One checked step: the grad_check `report`, the ranks' `trace` (records per rank),
    `params` ({name: per-rank LocalShard}) and the reference's forward `order`."""

    report: GradCheckReport
    trace: list
    params: dict
    order: list


def explore_check(lab, settings: Settings, config, atol: float, rtol: float) -> Exploration:
    """Run the Explorer's step on `lab`'s ranks and judge it against one device, every
    tensor as grad_check judges it (`tensor_rows`)."""
    ref = build_model(settings.model, config)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    x = models.make_input(config)
    order = forward_stages(ref, x)  # forward order, q/k/v and w1/w3 as branches
    x_ref = x.clone().requires_grad_(True)
    out = ref(x_ref)
    loss = 0.5 * out.pow(2).sum()
    loss.backward()
    results = lab.run(explore_step, settings.model, config, state, x, settings)
    rows = []

    def add(name, kind, values, reference):  # as grad_check reports each tensor
        rows.extend(tensor_rows(name, kind, values, reference, atol, rtol))

    add("output", "output", [r.output for r in results], out)
    add("loss", "output", [r.loss.reshape(1) for r in results], loss.reshape(1))
    add("input", "input_grad", [r.input_grad for r in results], x_ref.grad)
    for name, p in ref.named_parameters():
        add(name, "param_grad", [r.grads.get(name) for r in results], p.grad)
    report = GradCheckReport(rows, len(results), atol, rtol, loss.item())
    return Exploration(report, [r.records for r in results],
                       {k: [r.params[k] for r in results] for k in results[0].params}, order)


class Explorer(ExplorerPanel):
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
            done = explore_check(self.lab, s, self.config, self.atol, self.rtol)
            self.report, self.trace, self.params = done.report, done.trace, done.params
            self.figures = self._figures(done.order)
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

    def _figures(self, order: list) -> dict:
        what = self._describe()
        return {
            "flow": grad_flow(self.trace, order, title=f"Where the collectives sit: {what}"),
            "timeline": comm_timeline(self.trace, title=f"Collectives per rank: {what}"),
            "errors": grad_error(self.report, title=f"Errors against one device: {what}"),
            "sharding": sharding_map(self.params, title=f"Parameters' shards: {what}"),
        }
