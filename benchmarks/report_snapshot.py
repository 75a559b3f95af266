"""Snapshot grad_check's and train_check's reports on the lessons' models, to show that a
refactor leaves them as they were (issue 36: "a before/after comparison ... shows no
difference"). Runs under `tplab.simulate` at world 2 (tp=2, and dp=2 x tp=1 where the
lessons train data parallel); dumps every report's rows, notes and verdict as JSON.

    scripts/env.sh python benchmarks/report_snapshot.py --out before.json   # on the old tree
    scripts/env.sh python benchmarks/report_snapshot.py --out after.json    # on the new one
    scripts/env.sh python benchmarks/report_snapshot.py --compare before.json after.json

`--compare` prints each difference (a case, a row, a field) and exits 1 when there is one;
a field whose value is None counts as absent (a typed row has every field, a dict had only
those it was given).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys

import torch

import tplab
from tplab import megatron, models, plans

CFG = models.Config()


def no_reduce(model, mesh):
    """Notebook 01's bug: the Megatron MLP without f's all-reduce in backward."""
    return megatron.parallelize(model, mesh, reduce_grad=False)


def grad_cases():
    """(name, grad_check's arguments, its keywords) on the lessons' models."""
    x = functools.partial(models.make_input, CFG)
    tokens = functools.partial(models.make_tokens, CFG)
    mlp, block = functools.partial(models.MLP, CFG), functools.partial(models.Block, CFG)
    lm = functools.partial(models.TinyLM, CFG)
    return [
        ("mlp_dtensor", (mlp, plans.mlp(), x), {}),
        ("mlp_megatron", (mlp, megatron.parallelize, x), {}),
        ("mlp_no_reduce", (mlp, no_reduce, x), {}),
        ("block_sp", (block, plans.block(sequence_parallel=True), x), {}),
        ("block_megatron_sp", (block, functools.partial(megatron.parallelize,
                                                        sequence_parallel=True), x), {}),
        ("attention", (functools.partial(models.Attention, CFG), plans.attention(), x), {}),
        ("tinylm_loss_parallel", (lm, plans.lm(), tokens), {"loss_fn": models.lm_loss}),
        ("mlp_dp2", (mlp, {}, x), {"dp": 2}),
        ("mlp_dp2_not_averaged", (mlp, {}, x), {"dp": 2, "average_dp": False}),
        ("mlp_param_map", (mlp, megatron.parallelize, x),
         {"param_map": {"w1.weight": ("w1.weight", 0)}}),
    ]


def batches(i: int):
    return models.make_input(CFG, seed=100 + i)


def token_batches(i: int):
    return models.make_tokens(CFG, seed=100 + i)


def train_cases():
    mlp, block = functools.partial(models.MLP, CFG), functools.partial(models.Block, CFG)
    lm = functools.partial(models.TinyLM, CFG)
    return [
        ("mlp_dtensor", (mlp, plans.mlp(), batches), {"steps": 4}),
        ("mlp_no_reduce", (mlp, no_reduce, batches), {"steps": 3}),
        ("block_megatron", (block, megatron.parallelize, batches), {"steps": 3}),
        ("block_no_reduce", (block, no_reduce, batches), {"steps": 3}),
        ("block_sp", (block, plans.block(sequence_parallel=True), batches), {"steps": 3}),
        ("tinylm", (lm, plans.lm(), token_batches), {"steps": 3, "loss_fn": models.lm_loss}),
        ("mlp_dp2", (mlp, {}, batches), {"steps": 3, "dp": 2}),
    ]


def plain(value):
    """A JSON value for a report's field: tensors as lists, records as dicts, floats that
    are not finite as strings (so that nan == nan when compared)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "items"):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def row_dicts(rows) -> list[dict]:
    """The rows as dicts, whether a report holds dicts or records."""
    return [plain(r if hasattr(r, "items") else dataclasses.asdict(r)) for r in rows]


def snapshot() -> dict:
    out: dict = {"grad_check": {}, "train_check": {}}
    sim = tplab.simulate(world_size=2)
    for name, args, kw in grad_cases():
        torch.manual_seed(0)
        report = tplab.grad_check(sim, *args, **kw)
        out["grad_check"][name] = {"ok": report.ok, "rows": row_dicts(report.rows),
                                   "notes": plain(report.notes), "text": str(report)}
    for name, args, kw in train_cases():
        torch.manual_seed(0)
        report = tplab.train_check(sim, *args, live=False, **kw)
        out["train_check"][name] = {
            "ok": report.ok, "first_bad_step": report.first_bad_step,
            "diverged": plain(report.diverged), "detail": report.detail,
            "rows": row_dicts(report.rows), "notes": plain(report.notes),
            "summary": report.summary()}
    return out


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):  # a field that is None: as if absent
        return [d for k in sorted(set(a) | set(b)) if not (a.get(k) is None is b.get(k))
                for d in (differences(a[k], b[k], f"{where}.{k}") if k in a and k in b
                          else [f"{where}.{k}: only in {'before' if k in a else 'after'}"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} -> {b!r}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the snapshot here")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        found = differences(before, after)
        print("\n".join(found) or "no difference", f"({len(found)} differences)")
        return 1 if found else 0
    data = snapshot()
    text = json.dumps(data, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    cases = sum(len(v) for v in data.values())
    verdicts = [c["ok"] for v in data.values() for c in v.values()]
    print(f"{cases} reports, {sum(verdicts)} ok, {len(verdicts) - sum(verdicts)} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
