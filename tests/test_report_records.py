"""Report rows and trace records are typed frozen records (issue 36 item 7): their keys are
written once (the dataclass's fields), they read by key as the dicts they replaced did, and
grad_check, train_check and tplab.trace hand them out."""

from __future__ import annotations

import dataclasses
import functools
import pickle

import pytest

import tplab
from tplab import models, plans
from tplab.checks.grad_report import GradRow
from tplab.checks.train_report import TrainRow
from tplab.core.records import CollectiveRecord

CFG = models.Config(dim=16, hidden_dim=32, seq_len=4, batch_size=2)


def test_a_record_reads_by_key_and_is_frozen():
    row = GradRow("w1.weight", "param_grad", 0.5, 0.1, 1e-5, False, note="wrong")
    assert row["kind"] == "param_grad" and row.get("pair") == "" and row.get("nope", 3) == 3
    assert "note" in row and "nope" not in row
    assert dict(row) == dataclasses.asdict(row) and {**row}["max_abs"] == 0.5
    assert list(row) == [f.name for f in dataclasses.fields(GradRow)]
    with pytest.raises(KeyError, match="nope"):
        row["nope"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.note = ""
    assert dataclasses.replace(row, note="")["note"] == "" and row["note"] == "wrong"
    assert pickle.loads(pickle.dumps(row)) == row


def test_the_checks_and_the_trace_hand_out_records():
    sim = tplab.simulate(2)
    build = functools.partial(models.MLP, CFG)
    report = tplab.grad_check(sim, build, plans.mlp(), functools.partial(models.make_input, CFG))
    assert report.rows and all(isinstance(r, GradRow) for r in report.rows)
    train = tplab.train_check(sim, build, plans.mlp(), lambda i: models.make_input(CFG),
                              steps=2, live=False)
    assert [type(r) for r in train.rows] == [TrainRow, TrainRow] and train.rows[-1]["step"] == 2

    def traced():
        mesh = tplab.make_mesh(tp=2)
        model = tplab.apply_plan(build(), mesh, plans.mlp())
        with tplab.trace() as t:
            model(models.make_input(CFG)).sum().backward()
        return t.records

    records = sim.run(traced)[0]
    assert [(r["phase"], r["op"]) for r in records] == [("forward", "all_reduce")]
    assert all(isinstance(r, CollectiveRecord) and r["duration_ms"] >= 0 for r in records)
