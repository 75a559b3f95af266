"""grad_check on what frameworks do (issue 37 items 2, 4, 5, 6; issue 38 items 3, 14, 15):
a context entered on the ranks, outputs sharded or left per rank, the "summed copies" note
only where a collective could explain it, FSDP's sum convention, `_extra_state: None` in a
state_dict, a loss-parallel mean loss, and losses loss_parallel cannot run. Each verdict is
judged against plain torch on one device."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from tp_fixtures import CFG

import tplab
from tplab import fsdp, megatron, models, plans
from tplab.checks.grad_report import compare
from tplab.errors import LabError

BUILD = functools.partial(models.TinyLM, CFG)
TOKENS = functools.partial(models.make_tokens, CFG)


def mean_loss(out):
    return out.mean()


def smoothed_loss(out, tokens):
    return F.cross_entropy(out.flatten(0, 1), tokens.flatten(), label_smoothing=0.1)


def gathered_loss(out, tokens):
    return -F.log_softmax(out, -1).gather(-1, tokens[..., None]).mean()


def test_a_loss_parallel_mean_loss_is_averaged_not_summed():
    """Fails on main: the loss, a DTensor with Partial(avg), was summed (2x at world 2)."""
    tokens = TOKENS()
    truth = float(BUILD()(tokens).mean())  # plain torch, one device
    for world, dp in ((2, None), (4, None), (4, 2)):
        report = tplab.grad_check(tplab.simulate(world), BUILD, plans.lm(), TOKENS, mean_loss,
                                  dp=dp)
        assert report.ok, str(report)
        assert report.loss == pytest.approx(truth, rel=1e-5)
        if dp is None:
            note = next(r["note"] for r in report.rows if r["name"] == "loss")
            assert "averaged" in note


@pytest.mark.parametrize("loss", [smoothed_loss, gathered_loss])
def test_a_loss_loss_parallel_cannot_run_names_the_sharded_logits(loss):
    """Fails on main: "mixed torch.Tensor and DTensor", no word of the vocab or of what
    loss_parallel runs."""
    with pytest.raises(Exception) as err:
        tplab.grad_check(tplab.simulate(2), BUILD, plans.lm(), TOKENS, loss)
    text = str(err.value)
    assert "vocab" in text and "loss_parallel()" in text and "F.cross_entropy" in text
    assert "label_smoothing" in text and "output" in text


def local_logits_plan():
    plan = plans.lm()
    plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    return plan


def test_an_lm_head_that_hands_on_its_local_vocab_shard_is_named():
    """Fails on main: "IndexError: Target 31 is out of bounds"."""
    with pytest.raises(Exception) as err:
        tplab.grad_check(tplab.simulate(2), BUILD, local_logits_plan(), TOKENS, models.lm_loss)
    text = str(err.value)
    assert "local shard" in text and "use_local_output" in text and "(2, 4, 32)" in text


def test_a_sharded_plain_output_is_read_by_its_layout_and_a_per_rank_loss_declared():
    """The logits are each rank's vocab shard (a plain tensor). The default loss
    0.5 * sum(logits**2) on a shard is that shard's part of the whole loss, so every
    gradient is the one-device one (the truth below, plain torch: the sum of the shards'
    losses has the whole loss's gradient); only the loss itself is per rank. Fails on
    main: the output was "shape mismatch, max abs inf", and the gradients had no way to
    pass."""
    model, tokens = BUILD(), TOKENS()
    whole = model(tokens)
    parts = sum(0.5 * (p ** 2).sum() for p in whole.chunk(2, -1))
    assert torch.allclose(parts, 0.5 * (whole ** 2).sum())
    sim = tplab.simulate(2)
    report = tplab.grad_check(sim, BUILD, local_logits_plan(), TOKENS)
    failed = {(r["name"], r["kind"]) for r in report.failures}
    assert failed == {("loss", "output"), ("loss", "replica_spread")}, str(report)
    out = next(r for r in report.rows if r["name"] == "output" and r["kind"] == "output")
    assert out["ok"] and "read as Shard(2) (inferred)" in out["note"]
    assert "rank-local" in str(report) and "collective summed" not in str(report)
    ok = tplab.grad_check(sim, BUILD, local_logits_plan(), TOKENS,
                          outputs={"loss": "rank-local", "output": -1})
    assert ok.ok, str(ok)
    assert any("loss is rank-local" in n for n in ok.notes)
    assert "read as Shard(-1) (declared)" in str(ok)
    with pytest.raises(LabError, match="output.logits"):
        tplab.grad_check(sim, BUILD, local_logits_plan(), TOKENS,
                         outputs={"output.logits": "rank-local"})
    with pytest.raises(LabError, match="rank-local"):
        tplab.grad_check(sim, BUILD, local_logits_plan(), TOKENS, outputs={"loss": "local"})


def test_the_summed_copies_note_only_for_a_scale_a_collective_could_make():
    """Fails on main: a scalar 0.15% off was "= 1 x the reference (a collective summed 1
    copies?)", and any scale was blamed on a collective."""
    ref = torch.tensor([1.0, -2.0, 3.0])
    assert compare("x", "output", torch.tensor(1.0015), torch.tensor(1.0), 0, 0)["note"] == ""
    assert "summed 2 copies" in compare("x", "output", 2 * ref, ref, 0, 0, sizes=(2,))["note"]
    assert compare("x", "output", 3 * ref, ref, 0, 0, sizes=(2, 4))["note"] == ""
    assert compare("x", "output", 1.5 * ref, ref, 0, 0)["note"] == ""


ENTERED: list[str] = []


@contextlib.contextmanager
def training_context():
    """As torchtitan's: the model reads what the context set."""
    ENTERED.append("in")
    try:
        yield
    finally:
        ENTERED.append("out")


def needs_context(model, mesh):
    """A plan whose model runs only inside training_context (on the ranks)."""
    model = megatron.parallelize(model, mesh)
    forward = model.forward

    def guarded(*args, **kwargs):
        if len(ENTERED) % 2 == 0:
            raise RuntimeError("no training context")
        return forward(*args, **kwargs)

    model.forward = guarded
    return model


def test_a_context_is_entered_on_the_ranks_around_forward_and_the_loss():
    """Fails on main: grad_check has no context= (TypeError)."""
    ENTERED.clear()
    report = tplab.grad_check(tplab.simulate(2), BUILD, needs_context, TOKENS, models.lm_loss,
                              context=training_context)
    assert report.ok, str(report)
    assert ENTERED and ENTERED.count("in") == ENTERED.count("out") >= 1
    with pytest.raises(LabError, match="context"):
        tplab.grad_check(tplab.simulate(2), BUILD, needs_context, TOKENS, models.lm_loss,
                         context=training_context())


class WithExtraState(nn.Module):
    """A model whose state_dict holds `_extra_state: None`, as Megatron's modules do."""

    def __init__(self):
        super().__init__()
        self.inner = models.MLP(CFG)
        self.extra = Stateful()

    def forward(self, x):
        return self.inner(x)


class Stateful(nn.Module):
    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        assert state is None


def parallelize_inner(model, mesh):
    model.inner = megatron.parallelize(model.inner, mesh)
    return model


def test_none_in_a_state_dict_is_carried_not_cloned():
    """Fails on main: AttributeError: 'NoneType' object has no attribute 'detach'."""
    assert WithExtraState().state_dict()["extra._extra_state"] is None
    report = tplab.grad_check(tplab.simulate(2), WithExtraState, parallelize_inner,
                              functools.partial(models.make_input, CFG))
    assert report.ok, str(report)


def global_token_loss(out, tokens):
    """torchtitan's convention at dp=2: the replica's token losses over the global count."""
    return models.lm_loss(out, tokens) / 2


def test_the_sum_convention_without_fsdp_simulated():
    """dp_reduction="sum": the replicas' gradients summed, the loss divided by the global
    token count (the reference: the sum of the replicas' losses, which is the whole
    batch's mean, plain torch below). Fails on main: no dp_reduction= (TypeError)."""
    sim = tplab.simulate(4)
    model, tokens = BUILD(), TOKENS()
    report = tplab.grad_check(sim, BUILD, megatron.parallelize, TOKENS, global_token_loss,
                              dp=2, dp_reduction="sum")
    assert report.ok, str(report)
    assert "the sum of the 2 dp replicas' losses" in str(report)
    assert report.loss == pytest.approx(float(models.lm_loss(model(tokens), tokens)),
                                        rel=1e-5)
    with pytest.raises(LabError, match="dp_reduction"):
        tplab.grad_check(sim, BUILD, megatron.parallelize, TOKENS, dp=2, dp_reduction="avg")


def divide_by_one(model, mesh):
    """As torchtitan's parallelize_llama: FSDP2 with gradient_divide_factor=1.0 (on gloo a
    PREMUL_SUM, which gloo lacks, unless the reductions are sum-only)."""
    model = fsdp.apply_fsdp_tp(model, mesh, plans.lm())
    model.set_gradient_divide_factor(1.0)
    return model


@pytest.mark.slow
def test_fsdp2s_sum_convention_on_gloo(labs):
    """torchtitan's FSDP2 convention (gradients summed: `fsdp_tp(reduce="sum")` sets
    gradient_divide_factor=1.0) with a global-token loss passes under dp_reduction="sum",
    on gloo; FSDP2's default average is then caught. Fails on main (no dp_reduction=)."""
    lab = labs.get(4)
    summed = fsdp.fsdp_tp(plans.lm(), reduce="sum")
    report = tplab.grad_check(lab, BUILD, summed, TOKENS, global_token_loss, dp=2,
                              dp_reduction="sum")
    assert report.ok, str(report)
    titan = tplab.grad_check(lab, BUILD, divide_by_one, TOKENS, global_token_loss, dp=2,
                             dp_reduction="sum")
    assert titan.ok, str(titan)
    averaged = tplab.grad_check(lab, BUILD, fsdp.fsdp_tp(plans.lm()), TOKENS,
                                global_token_loss, dp=2, dp_reduction="sum")
    assert not averaged.ok
    assert {r["name"] for r in averaged.failures if r["kind"] == "param_grad"}


# train_check: the same options ---------------------------------------------------------------

def test_train_check_enters_the_context_and_carries_none_in_a_state_dict():
    """Fails on main: no context= (TypeError), and `_extra_state: None` crashed (.detach)."""
    ENTERED.clear()
    make = functools.partial(models.make_tokens, CFG, seed=0)
    report = tplab.train_check(tplab.simulate(2), BUILD, needs_context, lambda i: make(),
                               steps=2, loss_fn=models.lm_loss, live=False,
                               context=training_context)
    assert report.ok, str(report)
    assert ENTERED.count("in") == ENTERED.count("out") >= 2  # each step
    inputs = functools.partial(models.make_input, CFG, seed=0)
    extra = tplab.train_check(tplab.simulate(2), WithExtraState, parallelize_inner,
                              lambda i: inputs(), steps=2, live=False)
    assert extra.ok, str(extra)


def test_train_check_under_the_sum_convention_matches_plain_torch():
    """dp_reduction="sum" with a global-token loss: the one-device run minimises the
    whole batch's mean (plain torch below, the same losses); the ranks sum their
    gradients. Fails on main (no dp_reduction=)."""
    make = functools.partial(models.make_tokens, CFG, seed=0)
    report = tplab.train_check(tplab.simulate(4), BUILD, megatron.parallelize,
                               lambda i: make(), steps=2, loss_fn=global_token_loss, dp=2,
                               live=False, dp_reduction="sum",
                               make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert report.ok, str(report)
    model, tokens = BUILD(), make()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    truth = []
    for _ in range(2):
        loss = models.lm_loss(model(tokens), tokens)
        truth.append(float(loss))
        loss.backward()
        sgd.step()
        sgd.zero_grad()
    assert [r["ref_loss"] for r in report.rows] == pytest.approx(truth, rel=1e-5)
    with pytest.raises(ValueError, match="dp_reduction"):
        tplab.train_check(tplab.simulate(4), BUILD, megatron.parallelize, lambda i: make(),
                          steps=1, dp=2, dp_reduction="avg")


# typed jobs: the plan checked once, in the notebook -----------------------------------------

@pytest.mark.parametrize("which", ["grad_check", "train_check"])
def test_a_plan_is_checked_once_in_the_notebook_not_again_on_the_ranks(monkeypatch, which):
    """Fails on main: check_plan ran in the notebook and again on the ranks (apply_plan)."""
    calls = []
    real = tplab.plans.check_plan
    monkeypatch.setattr(tplab.plans, "check_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    sim = tplab.simulate(2)
    if which == "grad_check":
        report = tplab.grad_check(sim, BUILD, plans.lm(), TOKENS, models.lm_loss)
    else:
        make = functools.partial(models.make_tokens, CFG, seed=0)
        report = tplab.train_check(sim, BUILD, plans.lm(), lambda i: make(), steps=1,
                                   loss_fn=models.lm_loss, live=False)
    assert report.ok, str(report)
    assert len(calls) == 1
    with pytest.raises(tplab.errors.PlanError):  # and a wrong plan is still refused
        tplab.grad_check(sim, BUILD, {"layers.0.feed_forward.w1": ColwiseParallel(),
                                      "layers.0.feed_forward.w2": ColwiseParallel()},
                         TOKENS, models.lm_loss)


def test_no_arrow_runs_from_the_library_to_the_rank_side():
    """Issue 36 item 5: the helpers both sides use (the loss, the qk_norm answers) live in
    the both-sides library; core/ and the library import nothing from tplab/rank/. Fails on
    main (core/answers, fsdp, training/steps imported tplab.rank)."""
    from test_imports import BOTH, RANK, imports_of, module_files, side_of  # noqa: PLC0415

    modules = module_files()
    arrows = [f"{name} -> {imported}" for name, path in modules.items()
              if side_of(name) == BOTH
              for imported in imports_of(name, path, modules)
              if imported.startswith("tplab.") and side_of(imported) == RANK]
    assert arrows == []
