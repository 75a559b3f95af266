"""grad_check on models tplab did not write: a hand-written Megatron MLP with its own
parameter names (f right, f broken, a g that all-reduces in backward), outputs and inputs
as pytrees, param_map, unpaired parameters, tied ones, and a transformers Llama through
plans.from_hf. On simulated ranks and on processes."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tp_fixtures import llama, tp_lab  # noqa: F401

import tplab
from tplab import plans

D, H = 8, 16  # width and inner width: H divisible by 2 and 4


class Reference(nn.Module):
    """A plain MLP: fc1 then fc2, as a user would write it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MyF(torch.autograd.Function):
    """f: identity forward, all-reduce backward (or none, the bug: `reduce=False`)."""

    @staticmethod
    def forward(ctx, x, group, reduce):
        ctx.group, ctx.reduce = group, reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class MyG(torch.autograd.Function):
    """g: all-reduce forward, identity backward (or, the bug, all-reduce backward too)."""

    @staticmethod
    def forward(ctx, x, group, reduce_backward):
        ctx.group, ctx.reduce_backward = group, reduce_backward
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_backward:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def _rows(t, n, rank, dim):
    # index_select with a tensor index: in tplab.simulate `rank` holds every rank's value
    k = t.shape[dim] // n
    return nn.Parameter(t.detach().index_select(dim, torch.arange(k) + rank * k).clone())


class HandMLP(nn.Module):
    """A Megatron MLP written by hand, with shards named w1, b1, w2, b2."""

    def __init__(self, ref, mesh, f_reduces=True, g_backward=False, swap=False, extra=False):
        super().__init__()
        self.group, n, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.f_reduces, self.g_backward = f_reduces, g_backward
        if swap:  # registered out of the reference's order: order-and-shape pairing fails
            self.w2 = _rows(ref.fc2.weight, n, rank, 1)
        self.w1 = _rows(ref.fc1.weight, n, rank, 0)
        self.b1 = _rows(ref.fc1.bias, n, rank, 0)
        if not swap:
            self.w2 = _rows(ref.fc2.weight, n, rank, 1)
        self.b2 = nn.Parameter(ref.fc2.bias.detach().clone())
        # a parameter the reference does not have (a learned gate, only here)
        self.gate = nn.Parameter(torch.ones(3)) if extra else None

    def forward(self, x):
        x = MyF.apply(x, self.group, self.f_reduces)
        y = F.gelu(F.linear(x, self.w1, self.b1))  # (b, s, d) -> (b, s, h/n)
        z = MyG.apply(F.linear(y, self.w2), self.group, self.g_backward)  # -> (b, s, d)
        return z + self.b2 if self.gate is None else (z + self.b2) * self.gate.mean()


def hand(**kw):
    return functools.partial(_hand, **kw)


def _hand(model, mesh, **kw):
    return HandMLP(model, mesh, **kw)


def make_x():
    return torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))


def test_a_hand_written_mlp_with_its_own_names_pairs_by_order_and_shape(tp_lab):  # noqa: F811
    report = tplab.grad_check(tp_lab, Reference, hand(), make_x)
    assert report.ok, str(report)
    assert report.pairs == {"fc1.weight": "w1 Shard(0) (order and shape)",
                            "fc1.bias": "b1 Shard(0) (order and shape)",
                            "fc2.weight": "w2 Shard(1) (order and shape)",
                            "fc2.bias": "b2 Replicate() (order and shape)"}
    assert "w1 Shard(0)" in str(report) and "inf" not in str(report)


def test_a_broken_f_fails_exactly_the_input_gradient(tp_lab):  # noqa: F811
    report = tplab.grad_check(tp_lab, Reference, hand(f_reduces=False), make_x)
    assert {(r["name"], r["kind"]) for r in report.failures} == {
        ("input", "input_grad"), ("input", "replica_spread")}


def test_a_g_that_all_reduces_in_backward_scales_the_gradients_by_tp(tp_lab):  # noqa: F811
    n = tp_lab.world_size
    report = tplab.grad_check(tp_lab, Reference, hand(g_backward=True), make_x)
    # everything before g gets n copies of dL/dz summed; fc2's bias sits after g
    assert {(r["name"], r["kind"]) for r in report.failures} == {
        ("input", "input_grad"), ("fc1.weight", "param_grad"), ("fc1.bias", "param_grad"),
        ("fc2.weight", "param_grad")}
    for r in report.failures:
        assert r["note"].startswith(f"= {n} x the reference"), r


def test_an_unpaired_parameter_is_reported_as_such_never_as_wrong(tp_lab):  # noqa: F811
    report = tplab.grad_check(tp_lab, Reference, hand(extra=True), make_x)
    assert not report.ok
    assert [(r["name"], r["kind"]) for r in report.failures] == [("gate", "unpaired")]
    note = report.unpaired[0]["note"]
    assert "only on the ranks, local shape (3,)" in note and "param_map={'gate':" in note
    assert "UNPAIRED" in str(report) and "WRONG" not in str(report)
    assert "gate unpaired (not checked)" in report.summary()
    assert len([r for r in report.rows if r["kind"] == "param_grad" and r["ok"]]) == 4


def test_param_map_pairs_what_order_and_shape_gets_wrong():
    # at tp=2, w2's shard (8, 8) fits fc1.weight split on dim 0 as well as fc2.weight on
    # dim 1: registered first, order and shape pairs it with fc1.weight, which is wrong
    sim = tplab.simulate(2)
    report = tplab.grad_check(sim, Reference, hand(swap=True), make_x)
    assert report.pairs["fc1.weight"] == "w2 Shard(0) (order and shape)"
    assert ("fc1.weight", "param_grad") in {(r["name"], r["kind"]) for r in report.failures}
    for spec in ({"w2": "fc2.weight"}, {"w2": ("fc2.weight", 1), "w1": ("fc1.weight", 0)}):
        fixed = tplab.grad_check(sim, Reference, hand(swap=True), make_x, param_map=spec)
        assert fixed.ok, str(fixed)
        assert fixed.pairs["fc2.weight"] == "w2 Shard(1) (param_map)"
    wrong_dim = tplab.grad_check(sim, Reference, hand(swap=True), make_x,
                                 param_map={"w1": ("fc1.weight", 1)})
    assert "is not Shard(1) of that over tp=2" in wrong_dim.unpaired[0]["note"]
    with pytest.raises(tplab.LabError, match="no parameter 'w9'"):
        tplab.grad_check(sim, Reference, hand(), make_x, param_map={"w9": "fc1.weight"})


@dataclasses.dataclass
class Out:
    z: torch.Tensor
    mean: torch.Tensor
    label: str = "not a tensor"


class Shapes(nn.Module):
    """The Reference, returning its output as a tuple, a dict or a dataclass, and taking a
    tuple or dict of inputs."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.mlp = kind, Reference()

    def forward(self, x, scale=None):
        z = self.mlp(x if scale is None else x * scale)
        return {"tuple": (z, z.mean(-1)), "dict": {"z": z, "mean": z.mean(-1)},
                "dataclass": Out(z, z.mean(-1))}[self.kind]


MLP_PLAN = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_outputs_and_inputs_are_pytrees(tp_lab, kind):  # noqa: F811
    build = functools.partial(Shapes, kind)
    report = tplab.grad_check(tp_lab, build, MLP_PLAN, make_x)
    assert report.ok, str(report)
    names = {"tuple": ["output[0]", "output[1]"], "dict": ["output.z", "output.mean"],
             "dataclass": ["output.z", "output.mean"]}[kind]
    assert set(names) <= {r["name"] for r in report.rows if r["kind"] == "output"}
    if kind != "dataclass":
        return
    # two floating inputs, passed as model(*x) and model(**x): both gradients checked
    for inputs, want in (((make_x(), torch.tensor(1.5)), {"input[0]", "input[1]"}),
                         ({"x": make_x(), "scale": torch.tensor(1.5)},
                          {"input.x", "input.scale"})):
        r = tplab.grad_check(tp_lab, build, MLP_PLAN, lambda inputs=inputs: inputs,
                             loss_fn=lambda out: sum(t.sum() for t in _tensors(out)))
        assert r.ok, str(r)
        assert {row["name"] for row in r.rows if row["kind"] == "input_grad"} == want


def _tensors(out):
    from tplab.core.pytrees import leaves

    return [t for _, t in leaves(out)]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(D, H, bias=False)
        self.head = nn.Linear(H, D, bias=False)
        self.head2 = nn.Linear(D, H, bias=False)
        self.head2.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor(2.0))
        self.frozen = nn.Parameter(torch.ones(D), requires_grad=False)

    def forward(self, x):
        return self.head2(self.head(self.emb(x)) * self.scale * self.frozen)


def test_tied_parameters_buffers_and_frozen_ones_are_noted():
    from torch.distributed.tensor import Replicate

    sim = tplab.simulate(2)
    keeps_tie = {"head": RowwiseParallel(input_layouts=Replicate())}
    report = tplab.grad_check(sim, Tied, keeps_tie, make_x)
    assert report.ok, str(report)
    notes = " ".join(report.notes)
    assert "buffers are not compared" in notes and "scale" in notes
    assert "requires_grad=False" in notes and "frozen" in notes
    tied = next(r for r in report.rows if r["name"] == "emb.weight")
    assert tied["note"] == "tied: also head2.weight" and tied["pair"] == "Replicate()"
    # sharding emb replaces its weight by a DTensor: head2 keeps the old tensor, untied
    untied = tplab.grad_check(sim, Tied, {"emb": ColwiseParallel(),
                                          "head": RowwiseParallel()}, make_x)
    row = next(r for r in untied.rows if r["name"] == "emb.weight")
    assert row["ok"] and row["note"].startswith("tied in the reference, separate on the ranks")
    assert row["pair"] == "Shard(0); head2.weight Replicate() (name)"


def _tokens():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def test_a_transformersllama_under_its_own_published_plan(tp_lab):  # noqa: F811
    pytest.importorskip("transformers")
    if tp_lab.world_size == 2 and tp_lab.backend != "simulated":
        pytest.skip("processes at world size 4 (and simulated at 2 and 4) are enough")
    plan = plans.from_hf(llama())
    assert plan["model.layers.*.self_attn.q_proj"].__class__.__name__ == "ColwiseParallel"
    assert "lm_head" in plan  # the model class's own _tp_plan
    report = tplab.grad_check(tp_lab, llama, plan, _tokens,
                              loss_fn=lambda out: out.logits.pow(2).mean())
    assert report.ok, str(report)
    assert report.pairs["model.layers.0.self_attn.o_proj.weight"] == "Shard(1)"
    assert "output.logits" in {r["name"] for r in report.rows}


def test_from_hf_translates_the_published_styles():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    cfg = LlamaConfig()
    assert set(plans.from_hf(cfg, prefix="model.")) == {
        f"model.{k}" for k in cfg.base_model_tp_plan}
    cfg.base_model_tp_plan = {"layers.*.mlp.experts": "ep_dispatch_experts"}
    with pytest.raises(tplab.PlanError, match="'ep_dispatch_experts' is an expert-parallel "
                                              "style.*apply_transformers_plan"):
        plans.from_hf(cfg)


class Lookup(nn.Module):
    def __init__(self, vocab=30):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, D)

    def forward(self, tokens):
        return self.emb(tokens)


def _padded_vocab(model, mesh):
    """Megatron pads the vocabulary to a multiple of tp: 30 rows become 32 over 4 ranks."""
    from tplab import megatron

    n, vocab = mesh.size(), model.emb.num_embeddings
    padded = nn.Embedding(-(-vocab // n) * n, D)
    with torch.no_grad():
        padded.weight.zero_()
        padded.weight[:vocab] = model.emb.weight
    model.emb = megatron.VocabParallelEmbedding(padded, mesh)
    return model


def test_a_padded_vocabulary_is_cut_back_and_noted():
    sim = tplab.simulate(4)
    report = tplab.grad_check(sim, Lookup, _padded_vocab,
                              lambda: torch.arange(30).reshape(5, 6))
    assert report.ok, str(report)
    row = next(r for r in report.rows if r["name"] == "emb.weight")
    assert row["note"] == "padded to 32 on the ranks; the padding is not compared"
