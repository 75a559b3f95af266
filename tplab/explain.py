"""Why each collective ran, in words: a trace's records with their conjugates in the other
pass (`explain(records)`, `Trace.explain()`), and short labels for figures.

Works on records anywhere: on the ranks (`t.explain()`) or in the notebook on what
`lab.run` brought back (`explain(lab.run(step))`). The causes themselves are read on the
ranks when a collective is dispatched (tplab/causes.py).

The conjugate is the same operator's collective in the other pass (DESIGN.md's table):
all-reduce <-> identity, all-gather <-> reduce-scatter, all-to-all <-> all-to-all.
"""

from __future__ import annotations

from tabulate import tabulate

from tplab.core import ops, placements
from tplab.megatron.operators import OPERATORS

__all__ = ["Explanation", "conjugate", "explain", "short_cause"]

# tplab.megatron's operators whose conjugate is not a collective
_SPLIT = {"scatter": "split (keep my chunk)", "gather": "split (keep my chunk)"}


def conjugate(rec: dict) -> str:
    """The collective the same operator issues in the other pass, in words."""
    other = "backward" if rec.get("phase") == "forward" else "forward"
    cause, op = rec.get("cause") or "", rec.get("op")
    if cause in _SPLIT:
        return f"{_SPLIT[cause]} in the {other} pass"
    conj = ops.conjugate(op)
    if conj is None:
        return "?"
    text = f"{conj} in the {other} pass" if conj else f"identity in the {other} pass"
    if " -> " in cause:  # a DTensor redistribution: the reverse one
        before, _, after = cause.partition(" (")[0].partition(" -> ")
        if conj:
            text += f" ({_reverse(before, after, op)})"
    return text


def _reverse(before: str, after: str, op: str) -> str:
    # all-gather Shard(k) -> Replicate() pairs with reduce-scatter Partial(sum) -> Shard(k)
    if op == ops.ALL_GATHER:
        return f"{placements.PARTIAL} -> {before}"
    if op == ops.REDUCE_SCATTER:
        return f"{after} -> {placements.REPLICATE}"
    return f"{after} -> {before}"


def short_cause(cause: str) -> str:
    """A figure label for a cause: "P(sum)→R" for "Partial(sum) -> Replicate()", a
    tplab.megatron operator's name as it is (but "f" and "g", drawn as the role letter),
    "" for a line of user code (too long for a label)."""
    if " -> " in cause:
        return placements.short(cause.partition(" (")[0])
    if cause in OPERATORS.values() and cause not in ("f", "g"):
        return cause
    return ""


class Explanation(list):
    """`Trace.explain()`'s rows (dicts); a table in Jupyter and in print()."""

    columns = ("phase", "module", "op", "bytes", "cause", "conjugate")

    def _cells(self):
        for r in self:
            yield [r["phase"], r["module"] or "(whole model)", r["op"], r["bytes"],
                   r["cause"], r["conjugate"]]

    def __str__(self) -> str:
        return tabulate(list(self._cells()), headers=self.columns)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return tabulate(list(self._cells()), headers=self.columns, tablefmt="html")


def explain(records: list, rank: int = 0) -> Explanation:
    """One row per collective: phase, module, op, bytes, cause, and its conjugate in the
    other pass, looked up in the trace itself: the matching collective when one ran (the
    same module first), "none" when the gradient needed none (an all-gather whose
    gradient arrives whole is only split). `records`: one rank's (a Trace's), or a list
    per rank, as `lab.run` returns them (then `rank` picks one)."""
    if records and isinstance(records[0], (list, tuple)):
        records = records[rank]
    recs = sorted(records, key=lambda r: r.get("seq", 0))
    used: set[int] = set()
    rows = []
    for r in recs:
        text = conjugate(r)
        want = ops.conjugate(r["op"])
        if want and r.get("cause") not in _SPLIT:
            other = [i for i, o in enumerate(recs) if o["phase"] != r["phase"]
                     and o["op"] == want and i not in used]
            other.sort(key=lambda i: recs[i].get("module") != r.get("module"))
            if other:
                used.add(other[0])
                match = recs[other[0]]
                cause = match.get("cause") or ""
                text = f"{want} in the {match['phase']} pass" + (
                    f" ({cause.partition(' (')[0]})" if " -> " in cause else "")
            else:
                pass_ = "backward" if r["phase"] == "forward" else "forward"
                text = f"none in the {pass_} pass (no {want} was needed)"
        rows.append({"phase": r["phase"], "module": r.get("module", ""), "op": r["op"],
                     "bytes": r.get("bytes", 0), "cause": r.get("cause", ""),
                     "conjugate": text})
    return Explanation(rows)
