"""The placement names and the op table every side shares (`tplab.core.placements`,
`tplab.core.ops`), and trace labels read from each operator's `label` attribute
(`tplab.megatron`)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from tp_fixtures import CFG

import tplab
from tplab import megatron, models
from tplab.core import ops, placements
from tplab.mesh import make_mesh
from tplab.viz.palette import OPS as FIGURE_OPS


@pytest.mark.parametrize("p,text,kind", [
    (Shard(0), "Shard(0)", ("shard", 0)), (Shard(2), "Shard(2)", ("shard", 2)),
    (Replicate(), "Replicate()", ("replicate", None)),
    (Partial(), "Partial(sum)", ("partial", "sum")), (Partial("avg"), "Partial(avg)",
                                                      ("partial", "avg"))])
def test_a_name_is_torchs_spelling_and_reads_back(p, text, kind):
    assert placements.name(p) == text
    assert placements.parse(text) == kind
    assert placements.placement(text) == p


def test_short_and_long_forms():
    assert placements.parse("S(1)") == placements.parse("Shard(dim=1)") == ("shard", 1)
    assert placements.parse("_StridedShard(dim=1, split_factor=2)") == ("shard", 1)
    assert placements.long("P(sum)") == "Partial(sum)" and placements.long("R") == "Replicate()"
    assert placements.short("Partial(sum) -> Shard(0)") == "P(sum)→S(0)"
    with pytest.raises(ValueError, match="Bogus"):
        placements.parse("Bogus(1)")


def test_only_a_plain_shard_has_a_dim():
    assert placements.shard_dim("Shard(-1)") == -1 and placements.is_shard("Shard(3)")
    for text in ("_StridedShard(dim=1, split_factor=2)", "Replicate()", "Partial(sum)", None):
        assert placements.shard_dim(text) is None and not placements.is_shard(text)
    assert placements.is_partial("Partial(avg)") and not placements.is_partial(None)
    assert placements.placement(None) == Replicate()
    with pytest.raises(ValueError, match="_StridedShard"):
        placements.placement("_StridedShard(dim=1, split_factor=2)")


def test_the_op_table():
    for op in ops.TABLE.values():
        # conjugates pair up: the conjugate's conjugate is the op (all-reduce's is identity)
        assert op.conjugate == "" or ops.conjugate(op.conjugate) == op.name
    assert ops.conjugate("all_gather") == "reduce_scatter" and ops.conjugate("all_reduce") == ""
    assert ops.conjugate("no_such_op") is None
    assert ops.family("_all_gather_base") == "all_gather"
    assert ops.family("reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert set(ops.TP_OPS) <= set(ops.COSTED) <= set(ops.TABLE) == set(FIGURE_OPS)
    assert FIGURE_OPS["reduce_scatter"] == ("RS", "square", "reduce-scatter")


def test_every_operator_has_a_label():
    assert megatron.OPERATORS["CopyToTP"] == megatron.CopyToTP.label == "f"
    assert megatron.OPERATORS["ReduceFromTP"] == "g"
    functions = [v for v in vars(megatron).values()
                 if isinstance(v, type) and issubclass(v, torch.autograd.Function)
                 and v.__module__.startswith(megatron.__name__)]
    assert functions and all(isinstance(f.label, str) for f in functions)


def _causes(cfg):
    mesh = make_mesh()
    model = megatron.parallelize(models.MLP(cfg), mesh)
    with tplab.trace() as t:
        model(models.make_input(cfg).requires_grad_()).pow(2).sum().backward()
    return [(r["phase"], r["cause"]) for r in t.records]


def test_a_trace_label_is_the_functions_attribute(monkeypatch):
    cfg = CFG
    with tplab.simulate(2) as sim:
        assert sim.run(_causes, cfg)[0] == [("forward", "g"), ("backward", "f")]
        monkeypatch.setattr(megatron.ReduceFromTP, "label", "renamed g")
        assert sim.run(_causes, cfg)[0] == [("forward", "renamed g"), ("backward", "f")]
