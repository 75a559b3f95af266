"""tplab.plans and tplab.make_mesh: every PlanError case with its message, describe_plan's
rows (and that they agree with what parallelize_module does), and mesh shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tp_fixtures import CFG, activations, build, tp_lab  # noqa: F401

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
    from tplab.core import placements

    return {name: [placements.name(p) for p in param.placements]
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


# --- grouped-query attention and the vocabulary -------------------------------------------

GQA = dataclasses.replace(CFG, dim=32, n_heads=8, n_kv_heads=2)   # 4 query heads per KV head


def test_key_value_heads_bound_the_tp_degree():
    check_plan(models.Attention(GQA), plans.attention(), 2)        # 2 KV heads, 1 per rank
    with pytest.raises(PlanError, match=r"Attention: n_kv_heads = 2 \(key/value heads\) is not "
                                        r"divisible by tp = 4, so wk would split a key/value "
                                        r"head.*8 query heads are not the limit.*duplicated"):
        check_plan(models.Attention(GQA), plans.attention(), 4)   # though 8 query heads divide
    with pytest.raises(PlanError, match=r"n_heads = 8 is not divisible by tp = 16.*query"):
        check_plan(models.Attention(dataclasses.replace(GQA, dim=128, n_kv_heads=8)),
                   plans.attention(), 16)


def test_a_gqa_block_under_tp_computes_what_one_device_computes(tp_lab):  # noqa: F811
    import tplab

    cfg = dataclasses.replace(GQA, n_kv_heads=tp_lab.world_size)
    report = tplab.grad_check(tp_lab, build(models.Block, cfg), plans.block(),
                              activations(cfg))
    assert report.ok, str(report)
    assert report.pairs["attention.wk.weight"] == "Shard(0)"


def test_from_hf_checks_heads_and_vocab_against_tp():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
                      vocab_size=128256)                          # Llama 3 70B's sizes
    assert set(plans.from_hf(cfg, tp=8)) == set(plans.from_hf(cfg))
    with pytest.raises(PlanError, match=r"num_key_value_heads = 8 \(key/value heads\) is not "
                                        r"divisible by tp = 16; the 64 query heads"):
        plans.from_hf(cfg, tp=16)
    cfg.num_key_value_heads = 24
    with pytest.raises(PlanError, match=r"num_attention_heads = 64 \(query heads\) is not "
                                        r"divisible by tp = 3"):
        plans.from_hf(cfg, tp=3)
    cfg.num_key_value_heads, cfg.vocab_size = 8, 50257            # GPT-2's vocabulary
    with pytest.raises(PlanError, match=r"vocab_size = 50257 is not divisible by tp = 8 "
                                        r"\(50257 = 6282 x 8 \+ 1\); pad it to 51200"):
        plans.from_hf(cfg, tp=8)
    with pytest.warns(UserWarning, match="padded to 51200 rows"):
        plans.from_hf(cfg, tp=8, pad_vocab=True)


def test_megatron_pads_the_vocabulary_to_a_multiple_of_128_tp():
    assert plans.padded_vocab(128256, 8) == 129024 == 126 * 128 * 8
    assert plans.padded_vocab(50257, 1) == 50304
    assert plans.check_vocab(128256, 8) == 128256                # divisible: no padding
    with pytest.warns(UserWarning, match="50257 is not divisible by tp = 2"):
        assert plans.check_vocab(50257, 2, pad=True) == 50432
