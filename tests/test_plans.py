"""tplab.plans and tplab.make_mesh: every PlanError case with its message, describe_plan's
rows (and that they agree with what parallelize_module does), and mesh shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tp_fixtures import CFG, tp_lab  # noqa: F401

from tplab import PlanError, RankError, models, plans
from tplab.plans import check_plan, describe_plan

# --- PlanError ---------------------------------------------------------------------------


def test_a_key_that_matches_no_module_names_the_closest_paths():
    with pytest.raises(PlanError, match=r"'w3' matches no module of MLP; closest module "
                                        r"paths: 'w1', 'w2'"):
        check_plan(models.MLP(CFG), {"w1": ColwiseParallel(), "w3": RowwiseParallel()}, 2)
    lm = models.TinyLM(CFG)
    with pytest.raises(PlanError, match=r"'layers\.\*\.atention\.wq'.*'layers\.0\.attention\.wq'"):
        check_plan(lm, {"layers.*.atention.wq": ColwiseParallel()}, 2)


def test_a_dimension_not_divisible_by_tp_names_module_dimension_and_sizes():
    mlp = models.MLP(dataclasses.replace(CFG, hidden_dim=30))
    with pytest.raises(PlanError, match=r"w1: ColwiseParallel splits out_features \(weight dim 0\)"
                                        r" = 30 over tp = 4 ranks, and 30 is not divisible by 4"):
        check_plan(mlp, plans.mlp(), 4)
    check_plan(mlp, plans.mlp(), 2)  # 30 = 2 * 15 is fine
    lm = models.TinyLM(dataclasses.replace(CFG, vocab_size=30))
    with pytest.raises(PlanError, match=r"tok_embeddings: RowwiseParallel splits num_embeddings "
                                        r"\(weight dim 0\) = 30 over tp = 4"):
        check_plan(lm, plans.lm(), 4)


def test_heads_not_divisible_by_tp_is_a_plan_error_even_when_the_width_divides():
    cfg = dataclasses.replace(CFG, dim=24, n_heads=6)  # head_dim 4: wq has 24 = 4 * 6 outputs
    with pytest.raises(PlanError, match=r"attention: n_heads = 6 is not divisible by tp = 4, "
                                        r"so attention\.wq would split a head"):
        check_plan(models.Block(cfg), plans.block(), 4)
    check_plan(models.Block(cfg), plans.block(), 2)


def test_a_style_on_the_wrong_kind_of_module_is_a_plan_error():
    with pytest.raises(PlanError, match="attention_norm is a RMSNorm; ColwiseParallel only"):
        check_plan(models.Block(CFG), {"attention_norm": ColwiseParallel()}, 2)


def _apply(cfg, plan):
    from tplab import apply_plan, models
    from tplab.mesh import make_mesh

    apply_plan(models.MLP(cfg), make_mesh(), plan)


def _torch_only_warns(cfg):
    import warnings

    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from tplab import models
    from tplab.mesh import make_mesh

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(models.MLP(cfg), make_mesh(), {"w3": RowwiseParallel()})
    return [str(w.message) for w in caught]


def test_apply_plan_raises_on_the_ranks_where_parallelize_module_only_warns(tp_lab):  # noqa: F811
    with pytest.raises(RankError) as err:
        tp_lab.run(_apply, CFG, {"w1": ColwiseParallel(), "w3": RowwiseParallel()})
    assert "PlanError" in str(err.value) and "closest module paths: 'w1', 'w2'" in str(err.value)
    assert err.value.ranks == list(range(tp_lab.world_size))
    for messages in tp_lab.run(_torch_only_warns, CFG):
        assert any("'w3' could not be resolved" in m for m in messages)


# --- describe_plan -----------------------------------------------------------------------


def test_describe_plan_reads_like_a_table_of_layouts():
    rows = describe_plan(models.MLP(CFG), plans.mlp())
    assert rows == [
        {"module": "w1", "style": "ColwiseParallel",
         "parameters": {"weight": "Shard(0)", "bias": "Shard(0)"},
         "inputs": "Replicate()", "outputs": "Shard(-1) (local)"},
        {"module": "w2", "style": "RowwiseParallel",
         "parameters": {"weight": "Shard(1)", "bias": "Replicate()"},
         "inputs": "Shard(-1)", "outputs": "Partial(sum) -> Replicate() (local)"},
    ]
    text = str(rows)
    assert "module" in text.splitlines()[0] and "w2" in text and "<table" in rows._repr_html_()
    sp = describe_plan(models.Block(CFG), plans.block(sequence_parallel=True))
    assert sp[0] == {"module": "(root)", "style": "PrepareModuleInputOutput", "parameters": {},
                     "inputs": "Replicate() -> Shard(1) (local)",
                     "outputs": "Shard(1) -> Replicate() (local)"}
    assert {r["module"]: r["inputs"] for r in sp}["attention"] == "Shard(1) -> Replicate()"


def test_describe_plan_expands_wildcards_per_layer():
    cfg = dataclasses.replace(CFG, n_layers=2)
    rows = describe_plan(models.TinyLM(cfg), plans.lm(sequence_parallel=True))
    wq = [r["module"] for r in rows if r["module"].endswith("attention.wq")]
    assert wq == ["layers.0.attention.wq", "layers.1.attention.wq"]
    out = next(r for r in rows if r["module"] == "output")
    assert out["outputs"] == "Shard(-1)"  # kept sharded (a DTensor) for loss_parallel


def _placements(cfg, sequence_parallel):
    from tplab import apply_plan, models, plans
    from tplab.mesh import make_mesh

    model = apply_plan(models.TinyLM(cfg), make_mesh(), plans.lm(sequence_parallel))
    from tplab.transfer import placement_name

    return {name: [placement_name(p) for p in param.placements]
            if hasattr(param, "placements") else "plain"
            for name, param in model.named_parameters()}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_describe_plan_agrees_with_what_parallelize_module_does(tp_lab, sequence_parallel):  # noqa: F811
    plan = plans.lm(sequence_parallel)
    described = {f"{r['module']}.{p}": [layout] for r in describe_plan(models.TinyLM(CFG), plan)
                 for p, layout in r["parameters"].items()}
    actual = tp_lab.run(_placements, CFG, sequence_parallel)[0]
    assert described and {k: actual[k] for k in described} == described
    assert all(actual[k] == "plain" for k in actual if k not in described)  # untouched


# --- make_mesh ---------------------------------------------------------------------------


def _mesh(**dims):
    from tplab import make_mesh

    mesh = make_mesh(**dims)
    return list(mesh.mesh_dim_names), list(mesh.shape), mesh.device_type, mesh is make_mesh(
        **dims)


def test_make_mesh_names_its_dims_and_checks_the_world_size(tp_lab):  # noqa: F811
    n = tp_lab.world_size
    assert tp_lab.run(_mesh)[0] == (["tp"], [n], "cpu", True)
    assert tp_lab.run(_mesh, dp=n)[0] == (["dp"], [n], "cpu", True)
    if n == 4:
        assert tp_lab.run(_mesh, dp=2, tp=2)[0] == (["dp", "tp"], [2, 2], "cpu", True)
        with pytest.raises(RankError, match=r"make_mesh\(tp=2\) covers 2 ranks but the world "
                                            r"has 4: .* make_mesh\(tp=2, dp=2\)"):
            tp_lab.run(_mesh, tp=2)
    with pytest.raises(RankError, match=r"make_mesh\(tp=3\) covers 3 ranks"):
        tp_lab.run(_mesh, tp=3)


def test_every_named_plan_is_a_plain_dict_of_styles():
    for plan in (plans.mlp(), plans.attention(), plans.block(), plans.block(True), plans.lm(),
                 plans.lm(True, loss_parallel=False)):
        assert type(plan) is dict and plan
        assert all(isinstance(k, str) for k in plan)
        assert all(type(v).__module__.startswith("torch.distributed") for v in plan.values())
    assert isinstance(models.TinyLM(CFG).output, nn.Linear)
