"""transformers' published TP plans: grad_check's assembly of DTensors as DTensor places
them (`_StridedShard`, uneven shards) against `full_tensor()`; transformers' own TP as a plan
(`hf.apply_transformers_plan`) against `from_pretrained(tp_plan="auto")` and against an
independent judge; `from_hf`'s translations against transformers' own styles; from_hf's
checks and their order (issue 22, item 9)."""

from __future__ import annotations

import functools

import pytest
import torch

import tplab
from tplab import hf, hf_models
from tplab.core.pairing import gather_indexed
from tplab.layouts import global_index

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[2, 4], ids=["sim2", "sim4"])
def sim(request):
    return tplab.simulate(request.param)


def _pieces():
    """Rank side: DTensors of awkward layouts, their local pieces, indices and full_tensor()."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from tplab.mesh import make_mesh

    mesh = make_mesh(tp=dist.get_world_size())
    whole = torch.arange(4 * 8 * 6, dtype=torch.float32).reshape(4, 8, 6)
    out = {}
    for name, t, placement in (("packed", whole, _StridedShard(dim=1, split_factor=2)),
                               ("packed_last", whole, _StridedShard(dim=2, split_factor=3)),
                               ("uneven", torch.arange(7.0 * 3).reshape(7, 3), Shard(0))):
        dt = distribute_tensor(t, mesh, [placement], src_data_rank=None)
        index, why = global_index(dt)
        out[name] = (dt.to_local(), index, why, dt.full_tensor())
    return out


def test_strided_and_uneven_shards_assemble_as_full_tensor_gives_them(sim):
    per_rank = sim.run(_pieces)
    for name, (_, _, why, full) in per_rank[0].items():
        assert why is None, why
        values = [r[name][0] for r in per_rank]
        indexes = [r[name][1] for r in per_rank]
        whole, spread = gather_indexed(values, indexes, tuple(full.shape), False,
                                       sim.world_size)
        assert torch.equal(whole, full), name
        assert spread is None
        # the naive reading, one Shard block per rank, is not the tensor (packed: rank 0
        # holds a slice of each sub-matrix, not the first block)
        if name.startswith("packed"):
            dim = 1 if name == "packed" else 2
            assert not torch.equal(torch.cat(values, dim), full)


def _judge(build_model, state, x, overrides=None):
    """Rank side, independent of grad_check: transformers' own TP, gradients gathered with
    DTensor's own full_tensor()."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tplab.mesh import make_mesh

    model = build_model()
    model.load_state_dict(state)
    hf.apply_transformers_plan(model, make_mesh(tp=dist.get_world_size()), overrides)
    hf_models.logits_loss(model(**x)).backward()
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in model.named_parameters()}


def _judged(lab, name, overrides=None):
    build = functools.partial(hf_models.build, name)
    model = build()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = hf_models.tokens(name)
    hf_models.logits_loss(model(**x)).backward()
    grads = lab.run(_judge, build, state, x, overrides)
    wrong = set()
    for n, p in model.named_parameters():
        for g in grads:
            if not torch.allclose(g[n], p.grad, atol=1e-5, rtol=1e-4):
                wrong.add(n)
    return wrong


# the MoE experts' tensor-parallel rules transformers 5.24 publishes for Qwen3-MoE and Mixtral
# (5.25 leaves them out: under TP its experts stay whole on every rank, expert parallelism
# is its base_model_ep_plan); given as overrides where the installed plan lacks them
EXPERT_RULES = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                "model.layers.*.mlp.experts.down_proj": "rowwise",
                "model.layers.*.mlp.experts": "moe_tp_experts"}
# the pairing transformers' style gives the stacked gate_up weight (None: not in the plan)
GATE_UP_PAIRS = {"packed_colwise": "_StridedShard(dim=1, split_factor=2)", None: "Replicate()"}


def _experts_plans(name: str) -> list[dict | None]:
    """The plans whose experts a test checks: the published one (None), and the 5.24 expert
    rules as overrides where the installed plan leaves the experts out (while transformers
    still registers `moe_tp_experts`, deprecated in 5.25)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    published = hf_models.build(name).tp_plan
    if all(published.get(k) == v for k, v in EXPERT_RULES.items()):
        return [None]
    assert not EXPERT_RULES.keys() & published.keys(), published  # all or none
    return [None] + ([EXPERT_RULES] if "moe_tp_experts" in ALL_PARALLEL_STYLES else [])


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_grad_check_on_transformers_own_tp_agrees_with_full_tensor(name):
    sim = tplab.simulate(2)
    build = functools.partial(hf_models.build, name)
    for overrides in _experts_plans(name):
        report = tplab.grad_check(sim, build, functools.partial(hf.apply_transformers_plan,
                                                                overrides=overrides),
                                  functools.partial(hf_models.tokens, name),
                                  loss_fn=hf_models.logits_loss)
        assert report.ok, str(report)
        assert not _judged(sim, name, overrides)
        # the experts' pairing is the one the resolved plan's style implies
        style = hf.transformers_plan(build(), 2, overrides).get(
            "model.layers.0.mlp.experts.gate_up_proj")
        packed = next(v for k, v in report.pairs.items() if k.endswith("experts.gate_up_proj"))
        assert packed == GATE_UP_PAIRS[style], (overrides, style)
        assert not [r for r in report.rows if r["kind"] == "unreadable"]


def test_a_broken_transformers_plan_is_wrong_for_grad_check_and_for_the_judge():
    """q_norm/k_norm left plain replicated: their gradients are partial on each rank."""
    sim = tplab.simulate(2)
    broken = {"model.layers.*.self_attn.q_norm": "replicate",
              "model.layers.*.self_attn.k_norm": "replicate"}
    report = tplab.grad_check(sim, functools.partial(hf_models.build, "qwen3"),
                              functools.partial(hf.apply_transformers_plan, overrides=broken),
                              functools.partial(hf_models.tokens, "qwen3"),
                              loss_fn=hf_models.logits_loss)
    wrong = {r["name"] for r in report.failures}
    judged = _judged(sim, "qwen3", broken)
    assert wrong & judged == {"model.layers.0.self_attn.q_norm.weight",
                              "model.layers.0.self_attn.k_norm.weight"}
    assert not report.ok and all(r["kind"] in ("param_grad", "replica_spread")
                                 for r in report.failures)


def _both_ways(path, plan_fn):
    """Rank side: from_pretrained(tp_plan="auto") and the same checkpoint sharded by
    `plan_fn(model, mesh)`: every parameter's placements, local shard and local gradient."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from tplab.mesh import make_mesh

    world = dist.get_world_size()
    ours = AutoModelForCausalLM.from_pretrained(path)
    plan_fn(ours, make_mesh(tp=world))
    theirs = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"))
    x = hf_models.tokens("qwen3_moe")
    out = []
    for m in (theirs, ours):
        logits = m(**x).logits
        hf_models.logits_loss(type("O", (), {"logits": logits})).backward()
        local = {n: (repr(getattr(p, "placements", None)),
                     p.to_local() if hasattr(p, "to_local") else p.detach(),
                     p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                 for n, p in m.named_parameters()}
        out.append((logits.detach(), local))
    return out


@pytest.mark.slow
def test_apply_transformers_plan_is_what_from_pretrained_tp_plan_auto_does(labs, tmp_path):
    pytest.importorskip("accelerate")  # from_pretrained needs it for a device map
    hf_models.build("qwen3_moe").save_pretrained(tmp_path)
    for theirs, ours in labs.get(2).run(_both_ways, str(tmp_path), hf.apply_transformers_plan):
        assert torch.equal(theirs[0], ours[0])
        assert theirs[1].keys() == ours[1].keys()
        for name, (placements, local, grad) in theirs[1].items():
            assert ours[1][name][0] == placements, name
            assert torch.equal(ours[1][name][1], local), name
            assert torch.allclose(ours[1][name][2], grad, atol=1e-6), name


def _translated(build_model, state, x, overrides=None):
    """Rank side: the model sharded by transformers and by from_hf's translation (both with
    `overrides`): each parameter's placements and local shard, the logits and every local
    gradient."""
    import torch.distributed as dist

    from tplab.mesh import make_mesh
    from tplab.plans import apply_plan

    mesh = make_mesh(tp=dist.get_world_size())
    out = []
    for way in ("own", "from_hf"):
        model = build_model()
        model.load_state_dict(state)
        if way == "own":
            hf.apply_transformers_plan(model, mesh, overrides)
        else:
            apply_plan(model, mesh, hf.from_hf(model, overrides=overrides))
        logits = model(**x).logits
        hf_models.logits_loss(type("O", (), {"logits": logits})).backward()
        out.append({n: (repr(getattr(p, "placements", None)),
                        p.to_local() if hasattr(p, "to_local") else p.detach(),
                        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                    for n, p in model.named_parameters()} | {"logits": logits.detach()})
    return out


def _compare_translation(name, world=2, overrides=None, **sizes):
    build = functools.partial(hf_models.build, name, **sizes)
    model = build()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for own, ours in tplab.simulate(world).run(_translated, build, state,
                                               hf_models.tokens(name), overrides):
        assert torch.allclose(own.pop("logits"), ours.pop("logits"), atol=1e-6)
        for pname, (placements, local, grad) in own.items():
            if ours[pname][0] != placements:  # a tied weight torch's style unties
                assert "lm_head" in pname or "embed" in pname, (pname, placements)
                continue
            assert torch.equal(ours[pname][1], local), pname
            assert torch.allclose(ours[pname][2], grad, atol=1e-6), pname
    return set((model.tp_plan | (overrides or {})).values())


def test_from_hf_translations_shard_and_compute_as_transformers_does():
    """Qwen3-MoE: colwise, rowwise, the embedding, the lm head, the replicated q/k norms
    with their gradient all-reduce, packed experts and the MoE experts style (the 5.24
    rules as overrides where the installed plan leaves the experts whole)."""
    styles = set()
    for overrides in _experts_plans("qwen3_moe"):
        styles |= _compare_translation("qwen3_moe", overrides=overrides)
    assert {"replicated_with_grad_allreduce", "packed_colwise", "moe_tp_experts"} <= styles


def test_unit_colwise_translation_against_transformers():
    """transformers' `unit_colwise` (5.25: whole key/value heads on a (groups, replicas)
    view of the ranks) on Qwen3's k_proj and v_proj, at 2 KV heads on 4 ranks (each head on
    2 ranks, its output's gradient summed over them) and at 4 KV heads (one per rank),
    with `unit_rowwise` on o_proj; tplab's translation (`parallel_styles.UnitColwise`)
    shards and computes as transformers' own code does."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    if "unit_colwise" not in ALL_PARALLEL_STYLES:
        pytest.skip(f"transformers {transformers.__version__} has no unit_colwise (5.25 adds it)")
    units = {"model.layers.*.self_attn.k_proj": "unit_colwise",
             "model.layers.*.self_attn.v_proj": "unit_colwise"}
    _compare_translation("qwen3", 4, units, num_attention_heads=8, num_key_value_heads=2)
    _compare_translation("qwen3", 4, units | {"model.layers.*.self_attn.o_proj": "unit_rowwise"},
                         num_attention_heads=4, num_key_value_heads=4)


# one family for each remaining style transformers publishes (see docs/MODELS.md); the one
# family with "all_reduce" (inkling_text) does not run at tiny sizes under either plan
STYLE_FAMILIES = {"rowwise_split_input": "olmo2", "mla_kv_a_proj": "deepseek_v2",
                  "packed_rowwise": "aria_text", "local_params": "granite_swa",
                  "moe_identity_expert": "longcat_flash", "embedding_colwise": "qwen4_exp_text",
                  "unit_colwise": "minicpm5_moe"}


@pytest.mark.extended
@pytest.mark.parametrize("style", sorted(STYLE_FAMILIES))
def test_each_style_translation_against_transformers(style):
    from transformers import CONFIG_MAPPING

    family = STYLE_FAMILIES[style]
    # 5.25 moved the MoE styles to expert parallelism and added unit_colwise (minicpm5_moe)
    if family not in CONFIG_MAPPING or style not in set(hf_models.build(family).tp_plan
                                                        .values()):
        pytest.skip(f"transformers {transformers.__version__}: {family} does not publish "
                    f"{style}")
    assert style in _compare_translation(family)


def test_from_hf_knows_every_style_transformers_registers():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for name in ALL_PARALLEL_STYLES:
        assert name in hf.HF_SUPPORTED or name in hf.EP_STYLES, name
    cfg = hf_models.tiny_config("qwen3_moe")
    cfg.base_model_tp_plan = {"layers.*.mlp.experts": "ep_dispatch_experts"}
    with pytest.raises(tplab.PlanError, match="expert-parallel.*apply_transformers_plan"):
        hf.from_hf(cfg)
    assert tplab.plans.from_hf is hf.from_hf  # still importable from plans


def test_from_hf_checks_come_in_order_and_prefix_is_normalised():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(tplab.PlanError, match="GPT2Config publishes no base_model_tp_plan"):
        hf.from_hf(GPT2Config(), tp=8)           # not a vocabulary-padding error
    mha = LlamaConfig(num_attention_heads=32, num_key_value_heads=32, hidden_size=4096)
    with pytest.raises(tplab.PlanError, match="num_attention_heads = 32") as e:
        hf.from_hf(mha, tp=3)
    assert "KV heads" not in str(e.value) and "key/value" not in str(e.value)
    gqa = LlamaConfig(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    with pytest.raises(tplab.PlanError, match="num_key_value_heads = 8"):
        hf.from_hf(gqa, tp=16)
    # unit_colwise keeps whole KV heads, one on several ranks (transformers 5.25): allowed
    units = {"layers.*.self_attn.k_proj": "unit_colwise", "layers.*.self_attn.v_proj":
             "unit_colwise"}
    plan = hf.from_hf(gqa, tp=16, overrides=units)
    assert isinstance(plan["layers.*.self_attn.k_proj"], tplab.parallel_styles.UnitColwise)
    assert plan["layers.*.self_attn.k_proj"].head_dim == 4096 // 32
    with pytest.raises(tplab.PlanError, match="num_key_value_heads = 8"):
        hf.from_hf(gqa, tp=16, overrides={"layers.*.self_attn.k_proj": "unit_colwise"})
    keys = set(hf.from_hf(mha, prefix="model"))
    assert keys == set(hf.from_hf(mha, prefix="model.")) and all(
        k.startswith("model.layers.") for k in keys)
    for bad in ("model..", "mo del", 3):
        with pytest.raises(tplab.PlanError, match="prefix"):
            hf.from_hf(mha, prefix=bad)
    for bad in (["layers.*.mlp.up_proj"], {"layers.*.mlp.up_proj": 3}):
        with pytest.raises(tplab.PlanError, match="overrides: a dict"):
            hf.from_hf(mha, overrides=bad)
    with pytest.raises(tplab.PlanError, match="'no_such_style' is unknown"):
        hf.from_hf(mha, overrides={"layers.*.mlp.up_proj": "no_such_style"})


def _moe_causes(build_model, way, overrides=None):
    import torch.distributed as dist

    from tplab.mesh import make_mesh
    from tplab.plans import apply_plan
    from tplab.tracing import trace

    model = build_model()
    mesh = make_mesh(tp=dist.get_world_size())
    if way == "own":
        hf.apply_transformers_plan(model, mesh, overrides)
    else:
        apply_plan(model, mesh, hf.from_hf(model, overrides=overrides))
    with trace() as t:
        hf_models.logits_loss(model(**hf_models.tokens("qwen3_moe"))).backward()
    return [(r["phase"], r["module"], r["cause"]) for r in t.records]


@pytest.mark.parametrize("way", ["own", "from_hf"])
def test_causes_name_the_style_and_its_rule(way):
    from tplab.causes import REPLICATED_GRAD_RULE

    build = functools.partial(hf_models.build, "qwen3_moe")
    for overrides in _experts_plans("qwen3_moe"):
        records = tplab.simulate(2).run(_moe_causes, build, way, overrides)[0]
        norms = [c for p, m, c in records if m.endswith(("q_norm", "k_norm"))]
        assert len(norms) == 2 and all(REPLICATED_GRAD_RULE in c for c in norms)
        assert all(c.startswith("replicated_with_grad_allreduce") for c in norms)
        experts = [(p, c) for p, m, c in records if m.endswith("experts")]
        if hf.transformers_plan(build(), 2, overrides).get(
                "model.layers.0.mlp.experts") != "moe_tp_experts":
            assert experts == []  # whole experts on every rank: nothing to sum
            continue
        assert [p for p, _ in experts] == ["forward", "backward", "backward"]
        assert experts[0][1].startswith(("g (transformers'", "moe_tp_experts g"))
        assert all(c.startswith(("f (transformers'", "moe_tp_experts f"))
                   for _, c in experts[1:])
        if way == "from_hf":  # which rows of the packed weight each rank holds
            assert "rows r*8:(r+1)*8 of each of the 2 packed sub-matrices" in experts[1][1]


def test_a_packed_weight_split_as_one_block_is_wrong_and_packed_is_right(sim):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tplab import models, parallel_styles

    cfg = models.Config(dim=16, hidden_dim=4 * sim.world_size)
    build = functools.partial(models.PackedFeedForward, cfg)
    make_x = functools.partial(models.make_input, cfg)
    naive = tplab.grad_check(sim, build, {"gate_up_proj": ColwiseParallel(),
                                          "down_proj": RowwiseParallel()}, make_x)
    assert "output" in {r["name"] for r in naive.failures}
    packed = tplab.grad_check(sim, build, {"gate_up_proj": parallel_styles.PackedColwise(),
                                           "down_proj": RowwiseParallel()}, make_x)
    assert packed.ok, str(packed)
    assert packed.pairs["gate_up_proj.weight"] == "_StridedShard(dim=0, split_factor=2)"
    with pytest.raises(ValueError, match="split_factor"):
        parallel_styles.PackedColwise(0)


def test_grad_check_and_the_judge_agree_where_transformers_plan_is_wrong():
    """Apertus (transformers 5.24): the xIELU activation's alpha_p/alpha_n, replicated
    between the colwise up_proj and the rowwise down_proj, get partial gradients under the
    published plan. grad_check's wrong rows are exactly the judge's."""
    sim = tplab.simulate(2)
    report = tplab.grad_check(sim, functools.partial(hf_models.build, "apertus"),
                              hf.apply_transformers_plan,
                              functools.partial(hf_models.tokens, "apertus"),
                              loss_fn=hf_models.logits_loss)
    wrong = {r["name"] for r in report.failures if r["kind"] == "param_grad"}
    spread = {r["name"] for r in report.failures if r["kind"] == "replica_spread"}
    judged = _judged(sim, "apertus")
    assert wrong | spread == judged
    assert not [r for r in report.failures if r["kind"] not in ("param_grad", "replica_spread")]


@pytest.mark.parametrize("bad", ["llama", "meta-llama/Llama-3.2-1B", None, 3,
                                 {"model_type": "llama"}])
def test_from_hf_of_a_string_says_what_to_pass(bad):
    with pytest.raises(tplab.PlanError) as info:
        hf.from_hf(bad)
    text = str(info.value)
    assert "from_hf takes a transformers model or its config" in text, text
    assert "AutoConfig.from_pretrained" in text and "publishes no" not in text


class _NoRanks:
    world_size, closed, in_process = 2, False, True

    def run(self, *args, **kwargs):
        raise AssertionError("the ranks were asked to run")


def _llama_of_3_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=3,
                                        num_key_value_heads=3))


def test_apply_transformers_plan_with_heads_tp_does_not_divide_is_refused_before_the_ranks():
    tokens = functools.partial(torch.randint, 0, 32, (2, 4))
    for plan in (hf.apply_transformers_plan,
                 functools.partial(hf.apply_transformers_plan, overrides=None)):
        with pytest.raises(tplab.PlanError) as info:
            tplab.grad_check(_NoRanks(), _llama_of_3_heads, plan,
                             lambda: {"input_ids": tokens()}, loss_fn=hf_models.logits_loss)
        assert "num_attention_heads = 3" in str(info.value)
        assert "tp = 2" in str(info.value)
    # and on the ranks themselves, before transformers' code cuts a head in two
    with pytest.raises(tplab.PlanError, match="num_attention_heads = 3 .* tp = 2"):
        hf.check_heads(_llama_of_3_heads(), 2)
