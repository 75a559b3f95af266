"""tplab.plan_check: plans whose layouts do not chain are named before anything runs (both
modules, both placements, a fix); every plan tplab and transformers publish passes."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import tplab
from tplab import models, plans
from tplab.mesh import make_mesh
from tplab.plan_check import Edge, PlanCheckSkipped, check_layouts

CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=4,
                    batch_size=2)
GQA = models.Config(vocab_size=32, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    hidden_dim=32, seq_len=4, batch_size=2)
X = models.make_input(CFG)
TOKENS = models.make_tokens(CFG)


def raises(model, plan, x, *words):
    with pytest.raises(tplab.PlanError) as info:
        check_layouts(model, plan, x)
    text = str(info.value)
    assert text.startswith("layouts do not chain"), text
    for word in words:
        assert word in text, f"{word!r} not in: {text}"
    return text


# --- each mistake ---------------------------------------------------------------------


def test_a_colwise_feeding_a_colwise():
    text = raises(models.MLP(CFG), {"w1": ColwiseParallel(), "w2": ColwiseParallel()}, X,
                  "w1 (ColwiseParallel) hands w2 (ColwiseParallel)", "Shard(-1)",
                  "reads a plain input as Replicate()", "make w2 RowwiseParallel()",
                  "give w1 output_layouts=Replicate()")
    # and in a model's own words: attention's output projection planned column-wise
    raises(models.Block(CFG), plans.block() | {"attention.wo": ColwiseParallel()}, X,
           "attention.wq (ColwiseParallel) hands attention.wo (ColwiseParallel)",
           "make attention.wo RowwiseParallel()")
    assert "a and b must have same reduction dim" not in text


def test_a_rowwise_whose_input_is_replicated():
    raises(models.MLP(CFG), {"w2": RowwiseParallel()}, X,
           "the model's input (through w1) hands w2 (RowwiseParallel)", "Replicate()",
           "Shard(-1)", "make w1 ColwiseParallel()", "give w2 input_layouts=Replicate()")
    # a vocab-parallel embedding left with RowwiseParallel's default input (Shard(-1))
    raises(models.TinyLM(CFG), plans.lm() | {"tok_embeddings": RowwiseParallel()}, TOKENS,
           "the model's input hands tok_embeddings (RowwiseParallel)",
           "give tok_embeddings input_layouts=Replicate()")


class NormAfterLinear(nn.Module):
    """A projection straight into a LayerNorm (a post-norm layer), then a head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


class TinyRMSNorm(nn.Module):
    """A norm as transformers writes them (LlamaRMSNorm): not an nn.RMSNorm."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_an_output_left_sharded_into_a_norm():
    raises(NormAfterLinear(), {"proj": ColwiseParallel(), "head": RowwiseParallel()}, X,
           "proj (ColwiseParallel) hands norm (LayerNorm, not in the plan)", "Shard(-1)",
           "normalizes over its last dim", "give proj output_layouts=Replicate()")
    model = NormAfterLinear()
    model.norm = TinyRMSNorm(32)
    raises(model, {"proj": ColwiseParallel(), "head": RowwiseParallel()}, X,
           "hands norm (TinyRMSNorm, not in the plan)")
    # gathered first, the same norm is fine
    fixed = {"proj": ColwiseParallel(output_layouts=Replicate()),
             "head": ColwiseParallel(output_layouts=Replicate())}
    assert check_layouts(NormAfterLinear(), fixed, X)


def test_a_shard_into_an_unplanned_linear_and_into_a_residual_add():
    raises(models.MLP(CFG), {"w1": ColwiseParallel()}, X,
           "w1 (ColwiseParallel) hands w2 (nn.Linear, not in the plan)",
           "plan w2 as RowwiseParallel()")
    # wo gathers its input (input_layouts=Shard(-1)) but leaves its output sharded: the
    # residual add meets the whole x
    lm = plans.lm() | {"layers.*.attention.wo": ColwiseParallel(input_layouts=Shard(-1))}
    raises(models.TinyLM(CFG), lm, TOKENS, "layers.0.attention.wo (ColwiseParallel",
           "`add` in layers.0's forward", "a whole tensor from tok_embeddings",
           "give layers.0.attention.wo output_layouts=Replicate()")


def test_a_sequence_shard_read_as_whole():
    # SP norms hand on local sequence shards (use_local_output=True), but the attention is
    # left without its gather (PrepareModuleInput): wq reads Shard(1) as Replicate()
    plan = plans.block(True)
    del plan["attention"]
    plan["attention_norm"] = type(plan["ffn_norm"])(use_local_output=True)
    raises(models.Block(CFG), plan, X, "hands attention.wq (ColwiseParallel)",
           "sharded on dim 1 (Shard(1))", "input_layouts=Shard(1)")


# --- no false alarms ------------------------------------------------------------------


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("kind", ["mlp", "attention", "block", "lm", "gqa"])
def test_tplabs_own_plans_chain(kind, sp):
    model, plan, x = {
        "mlp": (models.MLP(CFG), plans.mlp(sp), X),
        "attention": (models.Attention(CFG), plans.attention(sp), X),
        "block": (models.Block(CFG), plans.block(sp), X),
        "lm": (models.TinyLM(CFG), plans.lm(sp), TOKENS),
        "gqa": (models.Block(GQA), plans.block(sp), models.make_input(GQA)),
    }[kind]
    edges = check_layouts(model, plan, x)
    assert edges, "the model ran on meta and every planned module was seen"
    planned = {p for key in plan for p, _ in plans.match(model, key)}
    assert {e.consumer for e in edges} <= planned
    assert all(e.layout == e.expected for e in edges if e.expected)  # what chained, did


def test_the_dataflow_order_and_who_feeds_whom():
    edges = check_layouts(models.Block(CFG), plans.block(), X)
    assert [e.consumer for e in edges] == ["attention.wq", "attention.wk", "attention.wv",
                                           "attention.wo", "feed_forward.w1",
                                           "feed_forward.w3", "feed_forward.w2"]
    assert Edge("attention.wq", "attention.wo", "Shard(-1)", "Shard(-1)") in edges
    assert Edge(None, "attention.wq", "Replicate()", "Replicate()") in edges
    assert edges[-1].producer in ("feed_forward.w1", "feed_forward.w3")


def _hf(family, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        family, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_hidden_layers=1, vocab_size=64, **extra)
    # the styles plans.from_hf may not translate yet (q_norm's replicated weight with an
    # all-reduced gradient: a replica, for layouts) are left out
    cfg.base_model_tp_plan = {k: v for k, v in cfg.base_model_tp_plan.items()
                              if v in ("colwise", "rowwise", "colwise_rep", "rowwise_rep",
                                       "embedding_rowwise", "colwise_gather_output")}
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model, plans.from_hf(model), {"input_ids": torch.randint(64, (2, 8))}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_transformers_published_plans_chain(family):
    model, plan, batch = _hf(family)
    edges = check_layouts(model, plan, batch)
    consumers = [e.consumer for e in edges]
    assert "model.layers.0.self_attn.o_proj" in consumers and consumers[-1] == "lm_head"
    assert Edge("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
                "Shard(-1)", "Shard(-1)") in edges  # through RoPE, GQA attention (and
    # Qwen3's q_norm over head_dim, which the head-sharded tensor reaches whole)
    broken = plan | {"model.layers.*.self_attn.o_proj": ColwiseParallel()}
    raises(model, broken, batch, "model.layers.0.self_attn.q_proj (ColwiseParallel",
           "hands model.layers.0.self_attn.o_proj (ColwiseParallel)")


class Custom(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


def test_unknown_styles_are_skipped_never_guessed():
    # after a style this check does not know, nothing downstream is judged
    edges = check_layouts(models.MLP(CFG), {"w1": Custom(), "w2": ColwiseParallel()}, X)
    assert edges == [Edge(None, "w2", "unknown", None)]
    # and inside it: a Rowwise that a custom style on its parent may well feed right
    block = {"feed_forward": Custom(), "feed_forward.w2": RowwiseParallel()}
    assert check_layouts(models.Block(CFG), block, X) == [
        Edge(None, "feed_forward.w2", "unknown", None)]


def test_a_model_that_cannot_run_on_meta_is_not_checked():
    class Item(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            scale = float(x.sum().item() > 0)  # a value from the data: none on meta
            return self.w2(self.w1(x)) * scale

    with pytest.warns(PlanCheckSkipped, match="data-dependent control flow") as seen:
        assert check_layouts(Item(), {"w1": ColwiseParallel(), "w2": ColwiseParallel()},
                             X) is None
    assert "the layouts were not checked" in str(seen[0].message)


def test_a_wrong_input_shape_says_the_check_was_skipped():
    with pytest.warns(PlanCheckSkipped, match="is its shape what the model takes"):
        assert check_layouts(models.MLP(CFG), plans.mlp(), torch.randn(2, 4, 8)) is None


def _prepared_step(plan, x):
    model = parallelize_module(models.MLP(CFG), make_mesh(tp=2)["tp"], plan)
    return model(x)


def test_a_prepare_module_input_of_equal_layouts_hands_its_module_a_shard():
    """PrepareModuleInput(Shard(-1) -> Shard(-1)) on an unsplit w2 moves nothing: w2's whole
    weight meets a local shard. The ranks fail, and the check says so first."""
    plan = {"w1": ColwiseParallel(), "w2": PrepareModuleInput(
        input_layouts=Shard(-1), desired_input_layouts=Shard(-1), use_local_output=True)}
    with pytest.raises(tplab.RankError):
        tplab.simulate(2).run(_prepared_step, plan, X)
    raises(models.MLP(CFG), plan, X, "w1 (ColwiseParallel",
           "w2 (nn.Linear, whose weights PrepareModuleInput leaves whole)",
           "give w1 output_layouts=Replicate()")
    # on the root (plan key ""), the message names the model, not an empty path
    root = {"": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1))}
    raises(models.MLP(CFG), root | plans.mlp(), X, "hands the model (PrepareModuleInput)",
           "give the model's PrepareModuleInput input_layouts=Replicate()")
    # one that gathers first is right, on the ranks and here
    ok = {"w1": ColwiseParallel(), "w2": PrepareModuleInput(
        input_layouts=Shard(-1), desired_input_layouts=Replicate(), use_local_output=True)}
    outs = tplab.simulate(2).run(_prepared_step, ok, X)
    assert all(torch.allclose(o, models.MLP(CFG)(X), atol=1e-5) for o in outs)
    assert check_layouts(models.MLP(CFG), ok, X) is not None


class DeclaredColwise(ParallelStyle):
    """A style of one's own that tells the check its layouts (as ColwiseParallel's)."""

    def _apply(self, module, device_mesh):
        return module

    def layout_contract(self, module):
        return [(0, Replicate(), Replicate(), False)], {}, [(None, Shard(-1), True)]


def test_a_style_that_declares_its_layouts_is_checked():
    raises(models.MLP(CFG), {"w1": DeclaredColwise(), "w2": ColwiseParallel()}, X,
           "w1 (DeclaredColwise) hands w2 (ColwiseParallel)", "Shard(-1)")
    assert check_layouts(models.MLP(CFG), {"w1": DeclaredColwise(), "w2": RowwiseParallel()},
                         X) == [Edge(None, "w1", "Replicate()", "Replicate()"),
                                Edge("w1", "w2", "Shard(-1)", "Shard(-1)")]


# --- where it is called ---------------------------------------------------------------


def test_check_plan_and_grad_check_name_the_mistake_before_the_ranks_run():
    bad = {"w1": ColwiseParallel(), "w2": ColwiseParallel()}
    with pytest.raises(tplab.PlanError, match="w1 .ColwiseParallel. hands w2"):
        plans.check_plan(models.MLP(CFG), bad, 2, X)
    plans.check_plan(models.MLP(CFG), bad, 2)  # without an input: keys and sizes only
    sim = tplab.simulate(2)
    with pytest.raises(tplab.PlanError) as info:
        tplab.grad_check(sim, functools.partial(models.MLP, CFG), bad,
                         functools.partial(models.make_input, CFG))
    assert not isinstance(info.value, tplab.RankError)  # raised here, not on the ranks
    assert sim.run(lambda: torch.distributed.get_world_size()) == [2, 2]


def _apply_and_call(plan):
    model = plans.apply_plan(models.MLP(CFG), make_mesh(tp=2), plan)
    return model(models.make_input(CFG)).shape


def test_apply_plan_checks_at_the_first_call_on_the_ranks():
    sim = tplab.simulate(2)
    with pytest.raises(tplab.PlanError, match="w1 .ColwiseParallel. hands w2") as info:
        sim.run(_apply_and_call, {"w1": ColwiseParallel(), "w2": ColwiseParallel()})
    assert "a and b must have same reduction dim" not in str(info.value)
    assert sim.run(_apply_and_call, plans.mlp()) == [torch.Size([2, 4, 16])] * 2


def _sp_block_fed_its_shards():
    mesh = make_mesh(tp=2)
    model = plans.apply_plan(models.Block(CFG), mesh, plans.block(True, standalone=False))
    x = models.make_input(CFG)
    n = x.shape[1] // 2  # this rank's piece of the sequence, as notebook 05 feeds it
    return model(x.index_select(1, torch.arange(n) + mesh.get_local_rank("tp") * n)).shape


def test_at_the_first_call_what_the_ranks_are_fed_is_not_assumed_whole():
    sim = tplab.simulate(2)
    assert sim.run(_sp_block_fed_its_shards) == [torch.Size([2, 2, 16])] * 2


def _unchecked(model, mesh):  # parallelize_module directly: no tplab check on the way
    return parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(),
                                                  "w2": ColwiseParallel(input_layouts=Shard(0))})


def _colcol_step():
    model = _unchecked(models.MLP(CFG), make_mesh(tp=2))
    return model(models.make_input(CFG))


def test_torchs_log_of_a_failed_propagation_stays_out_of_the_notebook(capfd):
    sim = tplab.simulate(2)
    with pytest.raises(tplab.RankError) as info:
        sim.run(_colcol_step)
    out, err = capfd.readouterr()
    assert "failed while attempting to run meta" not in out + err
    text = str(info.value)
    assert "failed while attempting to run meta" not in text
    path = text.rsplit("torch's own log of this failure: ", 1)[1].split(")")[0]
    with open(path) as log:
        assert "failed while attempting to run meta" in log.read()
    assert sim.run(lambda: torch.distributed.get_world_size()) == [2, 2]


@pytest.mark.slow
def test_on_rank_processes_the_log_is_in_the_ranks_own_file(labs, capfd):
    lab = labs.get(2)
    with pytest.raises(tplab.RankError) as info:
        lab.run(_colcol_step)
    assert "a and b must have same reduction dim" in str(info.value)
    out, err = capfd.readouterr()
    assert "failed while attempting to run meta" not in out + err + str(info.value)
    folder = os.path.join(lab.state_dir, "output")
    logs = [f for f in os.listdir(folder) if f.endswith(".torch.log")]
    assert len(logs) == 2
    texts = [open(os.path.join(folder, f)).read() for f in logs]
    assert all("failed while attempting to run meta" in t for t in texts)
    assert lab.run(lambda: torch.distributed.get_world_size()) == [2, 2]


# --- reductions written as functions, judged against what the ranks compute -----------

REDUCTIONS = {  # h: w1's output (batch, seq, 32), sharded on its last dim under Colwise
    "F.layer_norm(h, h.shape[-1:])": lambda h: F.layer_norm(h, h.shape[-1:]),
    "F.rms_norm(h, h.shape[-1:])": lambda h: F.rms_norm(h, h.shape[-1:]),
    "softmax(h, -1)": lambda h: F.softmax(h, -1),
    "torch.softmax(h, dim=-1)": lambda h: torch.softmax(h, dim=-1),
    "h.log_softmax(-1)": lambda h: h.log_softmax(-1),
    "h / h.norm(dim=-1, keepdim=True)": lambda h: h / h.norm(dim=-1, keepdim=True),
    "F.normalize(h, dim=-1)": lambda h: F.normalize(h, dim=-1),
    "h - h.mean(-1, keepdim=True)": lambda h: h - h.mean(-1, keepdim=True),
    "h * h.sum(dim=2, keepdim=True)": lambda h: h * h.sum(dim=2, keepdim=True),
    "h / h.var(-1, keepdim=True)": lambda h: h / h.var(-1, keepdim=True),
    "h / h.std(dim=-1, keepdim=True)": lambda h: h / h.std(dim=-1, keepdim=True),
    "h - h.amax(-1, keepdim=True)": lambda h: h - h.amax(-1, keepdim=True),
    "h - h.max(dim=-1, keepdim=True).values": lambda h: h - h.max(dim=-1,
                                                                 keepdim=True).values,
    "h - torch.logsumexp(h, -1, keepdim=True)": lambda h: h - torch.logsumexp(h, -1, True),
    "h.cumsum(-1)": lambda h: h.cumsum(-1),
    "h * h.sum()": lambda h: h * h.sum(),
    "h / torch.linalg.vector_norm(h, dim=-1, keepdim=True)":
        lambda h: h / torch.linalg.vector_norm(h, dim=-1, keepdim=True),
    # over other dims: right on the ranks, and not flagged
    "softmax(h, 1) (over the sequence)": lambda h: F.softmax(h, 1),
    "h - h.mean(1, keepdim=True)": lambda h: h - h.mean(1, keepdim=True),
    "h * h.amax(0)": lambda h: h * h.amax(0),
    "torch.maximum(h, h.flip(1))": lambda h: torch.maximum(h, h.flip(1)),
    "F.gelu(h)": F.gelu,
}


class ReduceBetween(nn.Module):
    """w1 (Colwise) -> a function of its output -> w2 (Rowwise)."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)
        models.init_weights(self, seed=3)

    def forward(self, x):
        return self.w2(self.op(self.w1(x)))


def _ranks_output(op, x):
    model = parallelize_module(ReduceBetween(op), make_mesh(tp=2)["tp"], plans.mlp())
    out = model(x)
    return out.wait() if hasattr(out, "wait") else out


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_a_reduction_over_the_sharded_dim_is_named_exactly_when_the_ranks_go_wrong(name):
    op = REDUCTIONS[name]
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    truth = ReduceBetween(op)(x)  # one device, whole tensors
    outs = tplab.simulate(2).run(_ranks_output, op, x)
    wrong = not all(torch.allclose(o, truth, atol=1e-5, rtol=1e-4) for o in outs)
    if wrong:
        raises(ReduceBetween(op), plans.mlp(), x, "reduces over dim 2, the sharded one",
               "w1 (ColwiseParallel)", "output_layouts=Replicate()")
    else:
        assert check_layouts(ReduceBetween(op), plans.mlp(), x) is not None


def _planned_at(tp: int, plan, x):
    model = parallelize_module(models.MLP(CFG), make_mesh(tp=tp)["tp"], plan)
    out = model(x)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def test_layouts_that_do_not_chain_are_right_on_one_tp_rank():
    """At tp = 1 every layout holds the whole tensor: a plan whose layouts would not chain
    at tp = 2 computes one device's values (the simulated rank says so), and check_plan
    passes it there; at tp = 2 it is refused."""
    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel()}
    (out,) = tplab.simulate(1).run(_planned_at, 1, plan, X)
    assert torch.allclose(out, models.MLP(CFG)(X), atol=1e-5)
    tplab.plans.check_plan(models.MLP(CFG), plan, 1, X)
    with pytest.raises(tplab.PlanError, match="layouts do not chain"):
        tplab.plans.check_plan(models.MLP(CFG), plan, 2, X)
