"""The grad_check report: one row per compared tensor, and how each was paired.

`compare(name, kind, value, reference)` makes a row (also what the Explorer uses);
`GradCheckReport` holds the rows, says ok or FAILED, and prints as a table (text and HTML).
A row is a `GradRow` (a frozen record, read by key as the dicts it replaced: `row["ok"]`):
name, kind, max_abs, max_rel, tol, ok, note, pair, mesh_dim. `tol` is the tolerance the row
was judged by, `atol + rtol * max|reference|` of that tensor (as torch.testing's
`assert_close` judges an element by `atol + rtol * |expected|`, here with the tensor's
scale: rounding in a TP run is relative to the largest terms, not to each element), so a
tensor of gradients about 1e-3 is judged at its own scale, not by a floor set for 1
(tplab/checks/grad_tolerance.py). Kinds: "output", "input_grad",
"param_grad", "replica_spread", "unpaired" (a parameter that could not be paired: not
checked, never "wrong"; the note says how to pair it with `param_map`) and "unreadable" (a
parameter whose layout on the ranks tplab cannot read: not checked, never "wrong").
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

from tplab.core.records import Record


@dataclass(frozen=True)
class GradRow(Record):
    """One compared tensor of a grad_check report (see the module doc): its name and kind,
    its largest absolute and relative error, the tolerance it was judged by, the verdict,
    a note, what it was paired with on the ranks, and for a wrong parameter gradient of a
    2-D check the mesh dim it comes from (tplab/fsdp_report.py), else None."""

    name: str
    kind: str
    max_abs: float
    max_rel: float
    tol: float
    ok: bool
    note: str = ""
    pair: str = ""
    mesh_dim: str | None = None


WORDS = {"output": "{name} wrong", "input_grad": "{name} gradient wrong",
         "param_grad": "gradient of {name} wrong",
         "replica_spread": "{name} differs across ranks",
         "unpaired": "{name} unpaired (not checked)",
         "unreadable": "{name}: layout on the ranks unreadable (not checked)"}


def _ratio(value: torch.Tensor, ref: torch.Tensor, sizes: tuple = ()) -> str:
    """"= 4 x the reference" when the error is a scale that a collective could make: a
    whole number of copies, one of the mesh's group sizes `sizes` when given."""
    v, r = value.double().flatten(), ref.double().flatten()
    rr = float(r @ r)
    if rr == 0:
        return ""
    k = float(v @ r) / rr
    n = round(k)
    if n < 2 or abs(k - n) > 1e-3 * n or (sizes and n not in sizes):
        return ""
    if float((v - k * r).abs().max()) > 1e-3 * float(r.abs().max()):
        return ""
    return f"= {n} x the reference (a collective summed {n} copies?)"


def compare(name: str, kind: str, value, ref, atol: float, rtol: float, note: str = "",
            pair: str = "", sizes: tuple = ()) -> GradRow:
    """A report row: `value` (a tensor, or a spread already measured) against `ref`.
    `sizes`: the mesh's group sizes, the only scales the note may blame on a collective."""
    ref = ref.detach() if isinstance(ref, torch.Tensor) else ref
    scale = float(ref.abs().max()) if ref is not None and ref.numel() else 0.0
    if value is None or ref is None or (isinstance(value, torch.Tensor)
                                        and value.shape != ref.shape):
        if not note:
            note = ("missing on the ranks" if value is None else "missing in the reference"
                    if ref is None else
                    f"shape {tuple(value.shape)} != reference {tuple(ref.shape)}")
        max_abs = math.inf
    elif isinstance(value, torch.Tensor):
        max_abs = float((value.double() - ref.double()).abs().max()) if ref.numel() else 0.0
        if max_abs > atol + rtol * scale and kind != "replica_spread" and not note:
            note = _ratio(value, ref, sizes)
    else:  # a spread, already a number
        max_abs = float(value)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    tol = atol + rtol * scale
    return GradRow(name, kind, max_abs, max_rel, tol, max_abs <= tol, note, pair)


def unpaired(name: str, note: str) -> GradRow:
    return GradRow(name, "unpaired", math.nan, math.nan, math.nan, False, note)


def unreadable(name: str, note: str) -> GradRow:
    return GradRow(name, "unreadable", math.nan, math.nan, math.nan, False, note)


@dataclass
class GradCheckReport:
    """Rows (`GradRow`s: name, kind, max_abs, max_rel, tol, ok, note, pair); `.ok` when every row is
    within its `tol`, atol + rtol * max|that tensor's reference|, and every parameter was
    paired. `notes`: what was
    not compared, and why (buffers, parameters that need no gradient, tied ones)."""

    rows: list[GradRow]
    world_size: int
    atol: float | None  # given (absolute), or None: a floor per kind (`floors`)
    rtol: float
    loss: float = float("nan")
    mesh_shape: dict | None = None  # {"dp": 2, "tp": 2} for a 2-D check
    notes: list[str] = field(default_factory=list)
    dtype: str = ""  # what the model computes in; the tolerances follow it (tplab.checks.grad)
    floors: dict[str, float] = field(default_factory=dict)  # {row kind: absolute floor}
    failures: list[GradRow] = field(init=False)

    def __post_init__(self):
        self.failures = [r for r in self.rows if not r["ok"]]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def unpaired(self) -> list[GradRow]:
        return [r for r in self.rows if r["kind"] == "unpaired"]

    @property
    def pairs(self) -> dict[str, str]:
        """{reference parameter: what it was compared with on the ranks}."""
        return {r["name"]: r["pair"] for r in self.rows
                if r["kind"] == "param_grad" and r.get("pair")}

    @property
    def max_abs(self) -> float:
        return max((r["max_abs"] for r in self.rows
                    if r["kind"] not in ("unpaired", "unreadable")), default=0.0)

    def summary(self) -> str:
        shape = self.mesh_shape or {}
        on = f" (dp={shape['dp']} x tp={shape['tp']})" if shape.get("dp", 1) > 1 else ""
        dtype = f"{self.dtype}: " if self.dtype else ""
        floor = (f"atol {self.atol:g}" if self.atol is not None else
                 "atol near zero: " + ", ".join(f"{k} {v:.1e}" for k, v in self.floors.items()))
        head = (f"grad_check on {self.world_size} ranks{on} "
                f"({dtype}{floor}, rtol {self.rtol:g} of each tensor's largest)")
        checked = [r for r in self.rows if r["kind"] not in ("unpaired", "unreadable")]
        if self.ok:
            return f"{head}: ok, {len(checked)} tensors, max abs error {self.max_abs:.2e}"
        parts = []
        for r in self.failures:
            what = WORDS.get(r["kind"], "{name}").format(name=r["name"])
            detail = "" if r["kind"] in ("unpaired", "unreadable") else \
                f"max abs {r['max_abs']:.2e}"
            detail += (", " if detail and r["note"] else "") + (r["note"] or "")
            parts.append(f"{what} ({detail})" if detail else what)
        return f"{head}: FAILED: " + "; ".join(parts)

    def _table(self, fmt: str) -> str:
        """The rows as a table; the note and pairing columns only when some row has one."""
        notes = any(r["note"] for r in self.rows)
        pairs = any(r.get("pair") for r in self.rows)
        headers = (["tensor", "kind"] + (["on the ranks"] if pairs else [])
                   + ["max abs", "max rel", "tolerance", "verdict"]
                   + (["note"] if notes else []))
        cells = []
        for r in self.rows:
            verdict = ("UNPAIRED" if r["kind"] == "unpaired" else "UNREADABLE"
                       if r["kind"] == "unreadable" else "ok" if r["ok"] else "WRONG")
            nums = (["-", "-", "-"] if r["kind"] in ("unpaired", "unreadable") else
                    [f"{r['max_abs']:.2e}", f"{r['max_rel']:.2e}", f"{r.get('tol', 0):.2e}"])
            cells.append([r["name"], r["kind"]] + ([r.get("pair", "")] if pairs else [])
                         + nums + [verdict] + ([r["note"]] if notes else []))
        return tabulate(cells, headers=headers, tablefmt=fmt)

    def __str__(self) -> str:
        tail = "".join(f"\nnote: {n}" for n in self.notes)
        return f"{self.summary()}\n{self._table('simple')}{tail}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        table = self._table("html")
        colour = "green" if self.ok else "red"
        tail = "".join(f"<p>note: {html.escape(n)}</p>" for n in self.notes)
        return f'<p style="color:{colour}">{html.escape(self.summary())}</p>{table}{tail}'
