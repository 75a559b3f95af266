"""What grad_check and train_check send the ranks (issue 36 item 4): a typed job, the plan
checked once in the notebook and applied unchecked on the ranks, the ranks' parameters
paired with the reference's in the notebook for both checks."""

from __future__ import annotations

import functools

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel

import tplab
from tplab import models, plan_check, plans
from tplab.rank.grad_step import GradJob
from tplab.rank.train_step import TrainJob, TrainResult

CFG = models.Config(dim=16, hidden_dim=32, seq_len=4, batch_size=2)
BUILD = functools.partial(models.MLP, CFG)


class Record:
    """The calls a Simulation's ranks got, and which plan checks ran while they ran."""

    def __init__(self):
        self.calls, self.on_ranks, self.checks = [], False, []


@pytest.fixture
def lab(monkeypatch):
    lab = tplab.simulate(2)
    lab.record = record = Record()
    run = lab.run

    def recording_run(fn, *args, **kwargs):
        record.calls.append((fn.__name__, args))
        record.on_ranks = True
        try:
            return run(fn, *args, **kwargs)
        finally:
            record.on_ranks = False

    def counted(fn):
        def check(*args, **kwargs):
            record.checks.append((fn.__name__, record.on_ranks))
            return fn(*args, **kwargs)
        return check

    monkeypatch.setattr(lab, "run", recording_run)
    # what apply_plan calls on a rank when the plan was not checked before
    monkeypatch.setattr(plans, "check_plan", counted(plans.check_plan))
    monkeypatch.setattr(plan_check, "check_at_first_call", counted(plan_check.check_at_first_call))
    return lab


def test_grad_check_sends_one_job_whose_plan_the_ranks_do_not_check(lab):
    report = tplab.grad_check(lab, BUILD, plans.mlp(), functools.partial(models.make_input, CFG))
    assert report.ok
    [(name, (job,))] = lab.record.calls
    assert name == "parallel_step" and isinstance(job, GradJob)
    assert job.plan.keywords["checked"] == "layouts"
    assert [name for name, _ in lab.record.checks].count("check_plan") == 1
    assert not [name for name, on_ranks in lab.record.checks if on_ranks]


def test_train_check_pairs_in_the_notebook_and_its_ranks_do_not_check_the_plan(lab):
    report = tplab.train_check(lab, BUILD, plans.mlp(), lambda i: models.make_input(CFG),
                               steps=2, live=False)
    assert report.ok, report.summary()
    assert [name for name, _ in lab.record.calls] == ["layout_on_ranks", "train_on_ranks"]
    job = lab.record.calls[-1][1][0]
    assert isinstance(job, TrainJob) and job.plan.keywords["checked"] == "layouts"
    # the pairs were made in the notebook (from the layouts the first call returned) and
    # sent; the ranks hand back no pairing of their own
    assert sorted(p.ranks for p in job.pairs) == ["w1.bias", "w1.weight", "w2.bias", "w2.weight"]
    assert "pairs" not in {f for f in TrainResult.__dataclass_fields__}
    assert [name for name, _ in lab.record.checks].count("check_plan") == 1
    assert not [name for name, on_ranks in lab.record.checks if on_ranks]


def test_train_check_refuses_a_wrong_handover_in_the_notebook_before_the_ranks(lab):
    def refuse(*args, **kwargs):
        raise AssertionError("the ranks were asked to run")

    lab.run = refuse  # the ranks must not be reached: the reference's first call finds it
    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel()}
    with pytest.raises(tplab.PlanError, match="w1 .ColwiseParallel. hands w2"):
        tplab.train_check(lab, BUILD, plan, lambda i: models.make_input(CFG), steps=2,
                          live=False)
