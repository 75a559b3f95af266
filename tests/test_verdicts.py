"""Verdicts you can trust (issue 27): train_check and grad_check on what a careless learner
tried, each against plain torch on one device; and random draws, correct or with a bug
planted, against an independent truth (tests/verdict_draws.py; 500 of them:
benchmarks/verdicts.py)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn as nn
import verdict_draws
from tp_fixtures import llama

import tplab
from tplab import megatron, models, plans, rng
from tplab.training import lm

CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=8,
                    batch_size=4)
MISSING_F = functools.partial(megatron.parallelize, reduce_grad=False)


class SeededNet(nn.Module):
    """An embedding, a tplab MLP (the TP region), torch's own dropout, a head."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.mlp = models.MLP(models.Config(dim=16, hidden_dim=32))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.head(self.drop(h + self.mlp(h)))


def seeded_build(p: float = 0.0):
    torch.manual_seed(0)  # the common habit: batches and masks then come from this stream
    return SeededNet(p)


def global_batch(i):
    return torch.randint(0, 32, (4, 8))  # the global RNG, no generator


def seeded_batch(i):
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i))


def lm_loss(out, tokens):
    return models.lm_loss(out, tokens)


def _plain_training(build, make_batch, steps, make_optimizer, loss):
    """Torch alone on one device: every step's parameters."""
    model = build()
    made = make_optimizer(model.parameters())
    opt, sched = made if isinstance(made, tuple) else (made, None)
    out = []
    for i in range(steps):
        batch = make_batch(i)
        loss(model(batch), batch).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def lab2(labs):
    return labs.get(2)


# 1: the band from the same batches and masks -----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_global_rng_batches_and_torch_dropout_give_the_band_of_the_same_run(lab2, p):
    build = functools.partial(seeded_build, p)
    ok = tplab.train_check(lab2, build, megatron.parallelize, global_batch, steps=3,
                           loss_fn=lm_loss, live=False)
    assert ok.ok, str(ok)
    # the same batches and masks: the band is rounding (it was 0.106 with p=0, 9.9 with p)
    assert max(r["param_band"] for r in ok.rows) < 1e-4, str(ok)
    bad = tplab.train_check(lab2, build, MISSING_F, global_batch, steps=3, loss_fn=lm_loss,
                            live=False)
    assert bad.first_bad_step == 1 and "emb.weight" in bad.detail, str(bad)


def test_torchs_dropout_on_simulated_ranks_is_refused_with_the_fix():
    with pytest.raises(tplab.LabError, match="drop is torch's Dropout.*tplab.rng.Dropout"):
        tplab.train_check(tplab.simulate(2), functools.partial(seeded_build, 0.3),
                          megatron.parallelize, seeded_batch, steps=1, loss_fn=lm_loss)


def test_a_band_run_replays_the_batches_and_the_masks_of_the_run_it_judges():
    from tplab.checks.train import run_reference

    torch.manual_seed(3)
    model, twin = SeededNet(0.3), SeededNet(0.3)
    twin.load_state_dict(model.state_dict())
    start, batches = torch.get_rng_state(), []
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    a = run_reference(model, global_batch, 3, None, sgd, lm_loss, batches=batches)
    torch.set_rng_state(start)
    b = run_reference(twin, global_batch, 3, None, sgd, lm_loss, batches=batches)
    assert len(batches) == 3 and torch.equal(a[2], b[2])  # the same checksums
    for name in a[1]:  # and the same masks: the very same parameters
        assert torch.equal(a[1][name], b[1][name]), name
    # plain torch, from the same state: the same trajectory
    fresh = SeededNet(0.3)
    fresh.load_state_dict({n: t[0] for n, t in a[1].items()})
    torch.set_rng_state(start)
    want = _plain_training(lambda: fresh, global_batch, 3, sgd, lm_loss)
    assert torch.equal(want[-1]["head.weight"], a[1]["head.weight"][-1])


# 2: the band covers what the optimizer does to rounding ------------------------------------

def cancelling_batch(i):
    """Column 0 sums to about 1e-8 over the 4 rows in one order, to 0 over each dp half
    (1 + 2e-8 rounds to 1 in float32): a weight gradient that cancels to rounding."""
    col = torch.tensor([1.0, 2e-8, -1.0, 2e-8])
    return torch.stack([col, torch.ones(4)], 1).unsqueeze(1)  # (4, 1, 2)


def linear_build():
    torch.manual_seed(0)
    return nn.Linear(2, 2, bias=False)


def mean_loss(out, batch):
    return out.mean()  # the mean of the dp halves' means is the whole batch's


def test_adams_first_step_on_a_gradient_that_cancels_is_inside_the_band():
    # the truth: a correct dp=2 run sums each half, then averages; Adam's first step
    # g / (|g| + eps) turns the rounding left in g into most of an lr
    one = linear_build()
    adam = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    x = cancelling_batch(0)
    whole_g = torch.autograd.grad(mean_loss(one(x), x), one.weight)[0]
    split_g = sum(torch.autograd.grad(mean_loss(one(h), h) / 2, one.weight)[0]
                  for h in x.chunk(2))
    assert float((whole_g - split_g).abs().max()) > 0  # rounding, legitimately
    ranks = [torch.optim.AdamW([nn.Parameter(one.weight.detach().clone())], lr=1e-3,
                               weight_decay=0.01) for _ in range(2)]
    moved = []
    for opt, g in zip(ranks, (whole_g, split_g), strict=True):
        opt.param_groups[0]["params"][0].grad = g
        opt.step()
        moved.append(opt.param_groups[0]["params"][0].detach())
    assert float((moved[0] - moved[1]).abs().max()) > 1e-4  # a tenth of lr, from rounding
    report = tplab.train_check(tplab.simulate(2), linear_build, lambda m, mesh: m,
                               cancelling_batch, steps=2, loss_fn=mean_loss, dp=2,
                               make_optimizer=adam)
    assert report.ok, str(report)


def llama_tokens(i):
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i))


def llama_loss(out, tokens):
    return models.lm_loss(out.logits, tokens)


def test_a_transformersllama_trains_under_the_default_adamw():
    pytest.importorskip("transformers")
    report = tplab.train_check(tplab.simulate(2), llama, plans.from_hf(llama()),
                               llama_tokens, steps=2, loss_fn=llama_loss)
    assert report.ok, str(report)


# 3: dp=2 with the default loss --------------------------------------------------------------

def _mlp_batch(i):
    return torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(i))


def _mlp():
    return models.MLP(models.Config(dim=8, hidden_dim=16))


def test_dp_with_the_default_sum_loss_compares_like_with_like():
    sim = tplab.simulate(2)
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    report = tplab.train_check(sim, _mlp, megatron.parallelize, _mlp_batch, steps=3, dp=2,
                               make_optimizer=sgd)
    assert report.ok, str(report)

    # the truth: each replica's half, its sum loss, gradients averaged (torch alone)
    def half_sums(out, batch):
        return sum(0.5 * o.pow(2).sum() for o in out.chunk(2)) / 2
    want = _plain_training(_mlp, _mlp_batch, 3, sgd, half_sums)
    first = _mlp()
    x = _mlp_batch(0)
    assert report.rows[0]["ref_loss"] == pytest.approx(float(half_sums(first(x), x)),
                                                       rel=1e-6)
    assert report.rows[0]["loss_diff"] <= report.rows[0]["loss_band"]
    from tplab.checks.train import run_reference

    _, traj, _ = run_reference(_mlp(), _mlp_batch, 3, None, sgd, None, dp=2)
    for name, t in traj.items():  # the reference is what the replicas train
        assert torch.allclose(t[-1], want[-1][name], atol=1e-6), name


# 4: a make_batch with its own generator on simulated ranks ---------------------------------

def test_simulated_ranks_take_a_make_batch_with_its_own_generator():
    report = tplab.train_check(tplab.simulate(2), _mlp, megatron.parallelize, _mlp_batch,
                               steps=2)
    assert report.ok, str(report)
    bad = tplab.train_check(tplab.simulate(2), _mlp, MISSING_F, _mlp_batch, steps=2)
    assert bad.ok  # an MLP alone: f's all-reduce reaches only the input, not a parameter
    assert not tplab.grad_check(tplab.simulate(2), _mlp, MISSING_F,
                                lambda: _mlp_batch(0)).ok  # whose gradient shows it


# 5: grad_check with tplab.rng.Dropout -------------------------------------------------------

def test_grad_check_draws_the_tp_masks_as_the_ranks_do():
    sim = tplab.simulate(2)
    plan = functools.partial(rng.parallelize, plan=megatron.parallelize, seed=None)
    tokens = functools.partial(models.make_tokens, CFG, seed=0)
    right = tplab.grad_check(sim, functools.partial(lm.DropoutLM, CFG, 0.1), plan, tokens,
                             loss_fn=models.lm_loss)
    assert right.ok, str(right)
    # the truth: the masks are dropout's, so the gradients differ from no dropout's
    plain = tplab.grad_check(sim, functools.partial(lm.DropoutLM, CFG, 0.0), plan, tokens,
                             loss_fn=models.lm_loss)
    assert plain.loss != pytest.approx(right.loss, rel=1e-4)
    wrong = tplab.grad_check(sim, functools.partial(lm.DropoutLM, CFG, 0.1, "tp", "tp"),
                             plan, tokens, loss_fn=models.lm_loss)
    assert not wrong.ok


# 8: tolerances follow the dtype --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_check_takes_the_tolerances_of_the_models_dtype(dtype):
    sim = tplab.simulate(2)
    build = functools.partial(lambda dt: models.TinyLM(CFG).to(dt), dtype)
    tokens = functools.partial(models.make_tokens, CFG, seed=0)
    report = tplab.grad_check(sim, build, megatron.parallelize, tokens,
                              loss_fn=models.lm_loss)
    assert report.ok, str(report)
    name = str(dtype).removeprefix("torch.")
    assert f"({name}: atol" in report.summary()
    assert report.rtol == tplab.checks.grad.TOLERANCES[dtype][1]
    # the truth in float32: what the tolerance must still catch, a missing f, is far out
    bad = tplab.grad_check(sim, build, MISSING_F, tokens, loss_fn=models.lm_loss)
    assert not bad.ok and any(r["max_rel"] > 2 * report.rtol for r in bad.failures)
    assert tplab.grad_check(sim, build, megatron.parallelize, tokens,
                            loss_fn=models.lm_loss, rtol=1e-4).ok is False  # given: kept


def test_a_one_device_run_that_overflows_is_named_not_compared():
    def explode(params):
        return torch.optim.SGD(params, lr=1e30)
    with pytest.raises(tplab.LabError, match="one-device run's loss is (inf|nan) at step 2"):
        tplab.train_check(tplab.simulate(2), _mlp, megatron.parallelize, _mlp_batch,
                          steps=3, make_optimizer=explode)


# 13: train_check's own arguments ------------------------------------------------------------

def sgd_with_scheduler(params):
    opt = torch.optim.SGD(params, lr=0.05)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_a_scheduler_is_stepped_like_torchs_own_loop():
    report = tplab.train_check(tplab.simulate(2), _mlp, megatron.parallelize, _mlp_batch,
                               steps=3, make_optimizer=sgd_with_scheduler)
    assert report.ok, str(report)

    def default(out, batch):
        return 0.5 * out.pow(2).sum()
    want = _plain_training(_mlp, _mlp_batch, 3, sgd_with_scheduler, default)
    no_schedule = _plain_training(_mlp, _mlp_batch, 3,
                                  functools.partial(torch.optim.SGD, lr=0.05), default)
    assert not torch.allclose(want[-1]["w2.weight"], no_schedule[-1]["w2.weight"])
    from tplab.checks.train import run_reference

    _, traj, _ = run_reference(_mlp(), _mlp_batch, 3, None, sgd_with_scheduler, None)
    assert torch.allclose(traj["w2.weight"][-1], want[-1]["w2.weight"], atol=1e-6)


def test_train_checks_arguments_are_named():
    sim = tplab.simulate(2)
    with pytest.raises(TypeError, match="lab must be a Lab"):
        tplab.train_check(None, _mlp, megatron.parallelize, _mlp_batch)
    with pytest.raises(TypeError, match="build_model must be a function.*MLP instance"):
        tplab.train_check(sim, _mlp(), megatron.parallelize, _mlp_batch)
    with pytest.raises(TypeError, match="make_optimizer must return a torch.optim.Optimizer"):
        tplab.train_check(sim, _mlp, megatron.parallelize, _mlp_batch, steps=1,
                          make_optimizer=lambda params: "adam")
    # a make_batch of no arguments: the same batch every step, as grad_check's make_input
    report = tplab.train_check(sim, _mlp, megatron.parallelize, lambda: _mlp_batch(0),
                               steps=2)
    assert report.ok, str(report)
    assert report.rows[1]["ref_loss"] < report.rows[0]["ref_loss"]  # trained on it twice


# 14: the same rows in a rank-dependent order --------------------------------------------------

def _shuffled_per_rank(i):
    x = _mlp_batch(i)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() % 2 == 1:
        return x.flip(0)  # the same rows, another order
    return x


@pytest.mark.slow
def test_rows_in_a_rank_dependent_order_are_another_batch(lab2):
    with pytest.raises(tplab.LabError, match="make_batch\\(0\\) gave rank 1 the same values "
                                             "in another order.*torch.Generator"):
        tplab.train_check(lab2, _mlp, megatron.parallelize, _shuffled_per_rank, steps=2,
                          live=False)


def test_the_batch_checksum_tells_an_order_from_a_sum():
    from tplab.rank.train_step import batch_sum

    x = _mlp_batch(0)
    a, b = batch_sum(x), batch_sum(x.flip(0))
    assert a[0] == pytest.approx(float(b[0]), rel=1e-12) and a[1] != b[1]
    assert torch.equal(batch_sum({"a": x, "b": x}), batch_sum({"a": x, "b": x.clone()}))


# 18: a run too long to keep -----------------------------------------------------------------

def test_steps_beyond_what_memory_keeps_are_refused_before_anything_runs():
    calls = []

    def batch(i):
        calls.append(i)
        return _mlp_batch(i)
    with pytest.raises(ValueError, match="steps=10000000 would keep .* GiB.*at most \\d+ steps"):
        tplab.train_check(tplab.simulate(2), _mlp, megatron.parallelize, batch, steps=10**7)
    assert calls == []


# the property: random draws against the truth -----------------------------------------------

def _agree(lab, dr):
    truth, ok = verdict_draws.judge(lab, dr)
    assert truth == "unclear" or (truth == "ok") == ok, (truth, ok, dr)
    return truth


@pytest.mark.parametrize("world", [2, 4])
def test_random_draws_agree_with_the_truth_simulated(world):
    r = random.Random(27 + world)
    lab = tplab.simulate(world)
    seen = [_agree(lab, verdict_draws.draw(r, world=world)) for _ in range(6 - world // 2)]
    assert "ok" in seen and "bad" in seen, seen  # both kinds were drawn


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_random_draws_agree_with_the_truth_in_processes(labs, world):
    r = random.Random(270 + world)
    lab = labs.get(world)
    for _ in range(4):
        _agree(lab, verdict_draws.draw(r, world=world))
