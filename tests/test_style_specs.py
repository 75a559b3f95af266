"""A style's contract declared once (tplab.style_specs): describe_plan, the plan check and
the trace's causes all read it, so that a new style is one class in one file."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

import tplab
from tplab import models, plan_check, plans, style_specs
from tplab import parallel_styles as ps
from tplab.errors import PlanError

# a style of one's own, written as a learner would, in a file of its own
NEW_STYLE = '''
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from tplab.parallel_styles import LocalParams, ShardParameters, reduce_with_cause
from tplab.style_specs import Collective, Handover, StyleSpec


class RowHalves(ParallelStyle):
    """Row-parallel by hand: each rank keeps its slice of the input features, reads the
    local Shard(-1) a column-parallel layer leaves, and sums the ranks' outputs (g)."""

    def spec(self, module, tp=None):
        return StyleSpec(params={"weight": Shard(1)},
                         inputs=(Handover(Shard(-1), Shard(-1), True),),
                         outputs=(Handover(Partial(), Replicate(), True),),
                         modules=(nn.Linear,),
                         divides=(("in_features", getattr(module, "in_features", 0)),),
                         forward=(Collective("all_reduce", "RowHalves g: each rank's slice of "
                                             "the features gives a partial sum"),))

    def _apply(self, module, device_mesh):
        ShardParameters(dict(self.spec(module).params))._apply(module, device_mesh)
        LocalParams()._apply(module, device_mesh)
        why = self.spec(module).forward[0].why
        module.register_forward_hook(
            lambda mod, args, out: reduce_with_cause(out, device_mesh.get_group(), why))
        return module
'''


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _new_style(tmp_path):
    path = tmp_path / "my_style.py"
    path.write_text(textwrap.dedent(NEW_STYLE))
    spec = importlib.util.spec_from_file_location("my_style", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RowHalves


def _traced(plan, state, x):
    from tplab.mesh import make_mesh

    model = TwoLayers()
    model.load_state_dict(state)
    model = tplab.apply_plan(model, make_mesh(), plan)
    x = x.clone().requires_grad_()  # so that w1's f all-reduces the input's gradient
    with tplab.trace() as t:
        out = model(x)
        out.sum().backward()
    return out.detach(), [(r["phase"], r["module"], r["op"], r["cause"]) for r in t.records]


def test_a_new_style_in_its_own_file_is_described_checked_and_explained(tmp_path):
    RowHalves = _new_style(tmp_path)
    model, x = TwoLayers(), torch.randn(2, 4, 16)
    plan = {"w1": ColwiseParallel(), "w2": RowHalves()}
    # described: from its spec, as torch's styles are
    assert plans.describe_plan(model, plan)[1] == {
        "module": "w2", "style": "RowHalves", "parameters": {"weight": "Shard(1)"},
        "inputs": "Shard(-1) (local)", "outputs": "Partial(sum) -> Replicate() (local)"}
    # checked: sizes, module kinds and layouts, each a PlanError naming the mistake
    plans.check_plan(model, plan, 2, x)
    with pytest.raises(PlanError, match="w2: RowHalves splits in_features = 32 over tp = 3"):
        plans.check_plan(model, {"w2": RowHalves()}, 3)
    with pytest.raises(PlanError, match="TwoLayers is a TwoLayers; RowHalves only splits "
                                        "nn.Linear"):
        plans.check_plan(model, {"w1": ColwiseParallel(), "": RowHalves()}, 2)
    gathered = {"w1": ColwiseParallel(output_layouts=Replicate()), "w2": RowHalves()}
    with pytest.raises(PlanError, match=r"w1 \(ColwiseParallel\) hands w2 \(RowHalves\) a "
                                        r"whole tensor.*reads a plain input as Shard\(-1\)"):
        plans.check_plan(model, gathered, 2, x)
    # explained: the trace's cause of its all-reduce is the reason its spec declares, and
    # the values are one device's
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    why = style_specs.spec_of(RowHalves(), model.w2).forward[0].why
    for out, records in tplab.simulate(2).run(_traced, plan, state, x):
        assert torch.allclose(out, model(x), atol=1e-5)
        assert ("forward", "w2", "all_reduce", why) in records
        assert ("backward", "w1", "all_reduce", "Partial(sum) -> Replicate()") in records


class Strict(ParallelStyle):
    def spec(self, module, tp=None):
        return style_specs.StyleSpec(divides=(("in_features", module.in_features),))

    def _apply(self, module, device_mesh):
        return module


def test_a_spec_that_cannot_read_its_module_is_a_plan_error_naming_both():
    with pytest.raises(PlanError, match="Strict.spec cannot describe a RMSNorm: "
                                        "AttributeError"):
        plans.check_plan(models.Block(models.Config()), {"attention_norm": Strict()}, 2)


def test_a_wrong_module_for_a_declared_style_is_named():
    with pytest.raises(PlanError, match="attention_norm is a RMSNorm; PackedColwise only "
                                        "splits nn.Linear"):
        plans.check_plan(models.Block(models.Config()), {"attention_norm": ps.PackedColwise()}, 2)


STYLES = {  # tplab's styles, each on a module it is made for
    "ShardParameters": (lambda: ps.ShardParameters({"weight": Shard(0)}),
                        nn.Linear(8, 8, bias=False)),
    "LocalParams": (ps.LocalParams, nn.Linear(8, 8)),
    "ReplicatedGradAllReduce": (ps.ReplicatedGradAllReduce, nn.RMSNorm(8)),
    "PackedColwise": (ps.PackedColwise, nn.Linear(8, 16)),
    "PackedRowwise": (lambda: ps.PackedRowwise({"weight": 2, "bias": 1}), nn.Linear(16, 8)),
    "MoEExperts": (ps.MoEExperts, nn.Linear(8, 8)),
    "AllReduceOutput": (ps.AllReduceOutput, nn.Linear(8, 8)),
    "MlaKvAProj": (lambda: ps.MlaKvAProj(4), nn.Linear(8, 12)),
    "ScaleInput": (ps.ScaleInput, nn.Identity()),
    "Styles": (lambda: ps.Styles(ps.ShardParameters({"weight": Shard(0)}), ps.LocalParams()),
               nn.Linear(8, 8)),
    "UnitColwise": (lambda: ps.UnitColwise(4), nn.Linear(8, 8)),
    "UnitRowwise": (lambda: ps.UnitRowwise(4), nn.Linear(8, 8)),
}


@pytest.mark.parametrize("name", sorted(STYLES))
def test_each_of_tplabs_styles_is_described(name):
    make, module = STYLES[name]
    style = make()
    assert type(style).__name__ == name
    assert isinstance(style_specs.spec_of(style, module, 2), style_specs.StyleSpec)
    (row,) = plans.describe_plan(nn.Sequential(module), {"0": style})
    cells = [row["inputs"], row["outputs"], *row["parameters"].values()]
    assert all("?" not in c and style_specs.NO_SPEC not in c for c in cells), row


def test_every_tplab_style_class_is_described_here():
    classes = {n for n, c in vars(ps).items() if isinstance(c, type) and
               issubclass(c, ParallelStyle) and c is not ps.TplabStyle}
    assert classes == set(STYLES)


def test_the_described_placements_are_what_applying_the_style_gives():
    sim = tplab.simulate(2)
    for name in ("ShardParameters", "PackedColwise", "PackedRowwise", "ReplicatedGradAllReduce"):
        make, module = STYLES[name]
        (row,) = plans.describe_plan(nn.Sequential(module), {"0": make()})
        got = sim.run(_placements, make(), module)[0]
        assert got == row["parameters"], name


def _placements(style, module):
    from tplab.core import placements
    from tplab.mesh import make_mesh

    model = tplab.apply_plan(nn.Sequential(module), make_mesh(), {"0": style})
    return {name.removeprefix("0."): placements.name(p.placements[0])
            if hasattr(p, "placements") else placements.REPLICATE
            for name, p in model.named_parameters()}


class Own(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


def test_a_style_without_a_spec_gets_a_clear_message_not_a_crash():
    plan = {"w1": Own(), "w2": RowwiseParallel()}
    (row, _) = plans.describe_plan(models.MLP(models.Config()), plan)
    assert row["inputs"] == style_specs.no_spec(Own())
    assert "Own declares no StyleSpec: give it a spec(module, tp=None) method" in row["inputs"]
    plans.check_plan(models.MLP(models.Config()), plan, 2)  # skipped, not judged
    assert style_specs.spec_of(Own(), nn.Linear(2, 2)) is None


def test_torchs_six_styles_are_in_one_table_and_a_subclass_keeps_its_sizes():
    assert len(style_specs.TORCH_SPECS) == 6

    class MyColwise(ColwiseParallel):
        pass

    mlp = models.MLP(models.Config())
    with pytest.raises(PlanError, match="w1: MyColwise splits out_features"):
        plans.check_plan(mlp, {"w1": MyColwise(), "w2": RowwiseParallel()}, 3)
    spec = style_specs.spec_of(MyColwise(), mlp.w1)
    assert not spec.layouts_known  # it may change the hooks: its layouts are not followed
    assert plan_check.check_layouts(mlp, {"w1": MyColwise(), "w2": ColwiseParallel()},
                                    models.make_input(models.Config())) == [
        plan_check.Edge(None, "w2", "unknown", None)]


def _ops(kind, sequence_parallel):
    from tplab.mesh import make_mesh

    cfg = models.Config()
    model = models.Block(cfg) if kind == "block" else models.MLP(cfg)
    plan = plans.block(sequence_parallel) if kind == "block" else plans.mlp(sequence_parallel)
    model = tplab.apply_plan(model, make_mesh(), plan)
    with tplab.trace() as t:
        model(models.make_input(cfg).requires_grad_()).pow(2).sum().backward()
    return [(r["phase"], r["module"], r["op"]) for r in t.records]


@pytest.mark.parametrize("kind, sp", [("mlp", False), ("block", True)])
def test_the_collectives_a_trace_sees_are_the_ones_the_specs_declare(kind, sp):
    cfg = models.Config()
    model = models.Block(cfg) if kind == "block" else models.MLP(cfg)
    plan = plans.block(sp) if kind == "block" else plans.mlp(sp)
    styles = plan_check.styles_by_module(model, plan)
    records = tplab.simulate(2).run(_ops, kind, sp)[0]
    assert records
    for phase, path, op in records:
        (style,) = styles[path]
        spec = style_specs.spec_of(style, model.get_submodule(path))
        declared = {c.op for c in (spec.forward if phase == "forward" else spec.backward)}
        assert op in declared, (phase, path, op, declared)
