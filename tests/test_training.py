"""tplab.train_check: each bug of a TP training run is caught at its first bad step, a
correct run passes, and the noise band tells reduction order from a bug.

The bugs (issue 20): per-rank clipping norms, dropout seeds wrong outside / inside the TP
regions, a missing f, weight decay chosen from a shard's size. Most cases run on rank
processes (a training step there costs milliseconds; simulated, about a second), a few
simulated; world 4 and 2-D are extended.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tplab
from tplab import megatron, models, plans, rng
from tplab.training import ReductionOrder, lm, steps

CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=8,
                    batch_size=4)
TINY = functools.partial(models.TinyLM, CFG)
DROPPY = functools.partial(lm.DropoutLM, CFG, 0.1)
BATCHES = lm.counting_batches(CFG)
MEGATRON = functools.partial(rng.parallelize, plan=megatron.parallelize, seed=1234)
STEP = functools.partial(steps.lm_step, max_norm=0.5)


def _train(lab, build=TINY, plan=MEGATRON, n=6, step=STEP, **kw):
    return tplab.train_check(lab, build, plan, BATCHES, steps=n, step=step, **kw)


@pytest.fixture(scope="module")
def lab2(labs):
    return labs.get(2)


def test_a_correct_run_passes_and_its_rows_say_what_was_compared(lab2):
    report = _train(lab2, build=DROPPY, n=8)
    assert report.ok, str(report)
    assert report.first_bad_step is None and report.diverged == []
    assert len(report.rows) == 8 and [r["step"] for r in report.rows] == list(range(1, 9))
    row = report.rows[-1]
    assert len(row["losses"]) == 2 and row["losses"][0] == row["losses"][1]
    assert abs(row["losses"][0] - row["ref_loss"]) <= row["loss_band"]
    # not trivially equal: the ranks drift by rounding, inside the band
    assert 0 < max(r["param_diff"] for r in report.rows) <= row["param_band"]
    assert row["replica_spread"] == 0.0
    assert report.rows[-1]["ref_loss"] < report.rows[0]["ref_loss"]  # it learns
    fig = report.figure()
    assert len(fig.data) == 1 + 2 + 3 and list(fig.data[0].x) == list(range(1, 9))


@pytest.mark.parametrize(("bug", "first"), [
    ("per-rank clipping", "replicated"),
    ("missing f", "replicated"),
    ("dropout per rank outside the TP regions", "loss"),
    ("dropout with one seed inside the TP regions", "loss"),
    ("weight decay chosen from a shard's size", "sharded"),
])
def test_each_bug_is_caught_at_its_first_bad_step(lab2, bug, first):
    kw = {
        "per-rank clipping": {"step": steps.per_rank_clipped_step(0.5),
                              "make_optimizer": steps.sgd},
        "missing f": {"plan": functools.partial(megatron.parallelize, reduce_grad=False)},
        "dropout per rank outside the TP regions": {
            "build": functools.partial(lm.DropoutLM, CFG, 0.1, "tp", "tp")},
        "dropout with one seed inside the TP regions": {
            "build": functools.partial(lm.DropoutLM, CFG, 0.1, "replicated", "replicated")},
        "weight decay chosen from a shard's size": {"make_optimizer": steps.decay_by_size},
    }[bug]
    report = _train(lab2, **kw)
    assert not report.ok
    assert report.first_bad_step == 1, str(report)
    assert first in report.diverged, report.detail
    words = {"loss": "the loss", "sharded": "a sharded parameter",
             "replicated": "a replicated parameter"}[first]
    assert f"{words} diverged first, at step 1" in report.detail or words in report.detail
    bad = report.rows[0]
    assert not bad["ok"]
    if first == "loss":
        assert bad["loss_diff"] > 100 * bad["loss_band"]
    else:
        assert bad["param_diff"] > 10 * bad["param_band"]
    assert "FAILED at step 1" in str(report)
    if bug in ("per-rank clipping", "missing f"):  # the replicas drift apart
        assert bad["replica_spread"] > 100 * bad["param_band"]


def test_the_fixes_pass_where_the_bugs_fail(lab2):
    # Megatron's clipping and weight decay chosen by ndim, on the same plain shards
    assert _train(lab2, make_optimizer=steps.decay_matrices).ok
    assert _train(lab2, make_optimizer=steps.sgd).ok
    # on DTensor parameters (all of them, under SP), torch's clip_grad_norm_ and numel()
    # are right
    dtensor = functools.partial(rng.parallelize, plan=plans.lm(sequence_parallel=True),
                                seed=1234)
    report = _train(lab2, build=DROPPY, plan=dtensor, step=steps.per_rank_clipped_step(0.5),
                    make_optimizer=steps.decay_by_size)
    assert report.ok, str(report)
    # tplab's clip_grad_norm on DTensor gradients (the norms' are Partial under SP)
    assert _train(lab2, build=DROPPY, plan=dtensor).ok


def _reordered(model, mesh):
    """A "parallel" model that is the whole model, every product summed in 4 parts."""
    forward = model.forward

    def reordered(*args, **kwargs):
        with ReductionOrder(4):
            return forward(*args, **kwargs)
    model.forward = reordered
    return model


def _off_by(model, mesh, eps=1e-4):
    """A real bug, as small: one weight nudged by eps (10^3 x the rounding)."""
    with torch.no_grad():
        model.norm.weight[0] += eps
    return model


def test_the_noise_band_tells_reduction_order_from_a_bug(lab2):
    noise = _train(lab2, plan=_reordered, n=10)
    assert noise.ok, str(noise)
    assert max(r["param_diff"] for r in noise.rows) > 0  # it does differ, in the last digits
    bug = _train(lab2, plan=_off_by, n=10)  # nudged before the first step: step 0
    assert not bug.ok and bug.first_bad_step == 0
    assert "initial weights" in bug.detail and "norm.weight" in bug.detail


def test_simulated_runs_pass_and_catch_a_missing_f():
    sim = tplab.simulate(2)
    assert _train(sim, n=2).ok
    report = _train(sim, plan=functools.partial(megatron.parallelize, reduce_grad=False), n=2)
    assert report.first_bad_step == 1 and report.diverged[0] == "replicated"


def _norms(build):
    mesh = tplab.make_mesh()
    model = megatron.parallelize(build(), mesh)
    models.lm_loss(model(BATCHES(0)), BATCHES(0)).backward()
    from tplab.training import grad_norm

    local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return grad_norm(model), local


def test_tp_aware_grad_norm_is_the_whole_models_on_every_rank():
    sim = tplab.simulate(2)
    ranks = sim.run(_norms, TINY)
    one = TINY()
    models.lm_loss(one(BATCHES(0)), BATCHES(0)).backward()
    whole = torch.nn.utils.get_total_norm([p.grad for p in one.parameters()])
    for tp_norm, local in ranks:
        assert torch.allclose(tp_norm, whole, rtol=1e-5)
        assert not torch.allclose(local, whole, rtol=1e-3)  # torch's: this rank's pieces
    assert not torch.equal(ranks[0][1], ranks[1][1])


def test_bad_arguments_are_named():
    sim = tplab.simulate(2)
    with pytest.raises(ValueError, match="steps"):
        tplab.train_check(sim, TINY, MEGATRON, BATCHES, steps=0)
    with pytest.raises(TypeError, match="make_batch"):
        tplab.train_check(sim, TINY, MEGATRON, None)
    with pytest.raises(ValueError, match="loss_fn"):
        tplab.train_check(sim, TINY, MEGATRON, BATCHES, step=STEP, loss_fn=models.lm_loss)
    with pytest.raises(TypeError, match="live"):
        tplab.train_check(sim, TINY, MEGATRON, BATCHES, live="yes")


def _random_batch(i):
    return torch.randint(CFG.vocab_size, (CFG.batch_size, CFG.seq_len))


def test_a_batch_that_differs_between_notebook_and_ranks_is_named(lab2):
    with pytest.raises(tplab.LabError, match="make_batch"):
        tplab.train_check(lab2, TINY, MEGATRON, _random_batch, steps=2, step=STEP)


@pytest.mark.extended
@pytest.mark.parametrize("sp", [False, True])
def test_world_4_tp_sp_and_2d(labs, sp):
    lab4 = labs.get(4)
    dtensor = functools.partial(rng.parallelize, plan=plans.lm(sequence_parallel=sp))
    assert _train(lab4, build=DROPPY, plan=dtensor, n=10).ok
    hand = functools.partial(rng.parallelize, plan=functools.partial(
        megatron.parallelize, sequence_parallel=sp))
    assert _train(lab4, build=DROPPY, plan=hand, n=10).ok
    assert _train(lab4, build=DROPPY, plan=hand, n=10, dp=2).ok
    bug = _train(lab4, plan=hand, n=10, dp=2, step=steps.per_rank_clipped_step(0.5),
                 make_optimizer=steps.sgd)
    assert bug.first_bad_step == 1


def _cli(*args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tplab", "check", *args],
                          cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                          text=True, timeout=240)


def test_cli_train_refuses_step_without_train_and_a_bad_count(monkeypatch, capsys):
    """Argument errors, in this process: `python -m tplab`'s main with what the command line
    gives it (the command in a fresh process: the runs below and tests/test_cli_check.py)."""
    import os
    import sys

    from tplab.__main__ import main

    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setattr(sys, "path", list(sys.path))  # main adds the working directory
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # and to PYTHONPATH
    targets = ("train_targets:build", "tplab.megatron:parallelize", "train_targets:make_batch",
               "--world-size", "2")
    assert main(["check", *targets, "--step", "train_targets:step"]) == 2
    assert "--train" in capsys.readouterr().err
    assert main(["check", *targets, "--train", "0"]) == 2
    assert "--train STEPS must be >= 1" in capsys.readouterr().err


@pytest.mark.extended
def test_cli_train_passes_a_correct_run():
    ok = _cli("train_targets:build", "tplab.megatron:parallelize", "train_targets:make_batch",
              "--world-size", "2", "--simulated", "--train", "2", "--step",
              "train_targets:step")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "train_check passed: 2 steps on 2 ranks" in ok.stdout


@pytest.mark.extended
def test_cli_train_fails_a_missing_f_with_exit_1():
    bad = _cli("train_targets:build", "train_targets:missing_f", "train_targets:make_batch",
               "--world-size", "2", "--simulated", "--train", "2", "--step",
               "train_targets:step")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED at step 1" in bad.stdout and "replicated parameter" in bad.stdout


def test_the_live_view_takes_the_ranks_lines_out_of_the_output_and_redraws():
    import io

    from tplab.checks.train_live import LiveTraining
    from tplab.lab.streams import LiveOutput
    from tplab.rank.train_step import LIVE_PREFIX, LIVE_SUFFIX

    band = {"param": [1e-5] * 5}
    view = LiveTraining(2, torch.tensor([3.0, 2.5, 2.0, 1.5]), band, widget=False)
    out = io.StringIO()
    live = LiveOutput([0, 1], stdout=out, stderr=io.StringIO(), live=False)
    with view.listening():
        for step in (1, 2):
            live.feed([(r, "stdout", f'{LIVE_PREFIX}{{"rank": {r}, "step": {step}, "loss": '
                                     f'{3.0 - step / 10}, "diff": 1e-7}}{LIVE_SUFFIX}\nhello\n')
                       for r in (0, 1)])
            view.redraw()
        live.flush(final=True)
    assert view.seen == 2 and view.rows[1]["losses"] == [2.8, 2.8]
    assert view.updates >= 2
    drawn = view.bundle()["application/vnd.plotly.v1+json"]["data"]
    assert list(drawn[1]["y"]) == [2.9, 2.8]  # rank 0's curve, two steps so far
    assert list(drawn[0]["y"]) == [3.0, 2.5, 2.0, 1.5]  # the reference, drawn whole
    assert "tplab-train" not in out.getvalue() and "[ranks 0,1] hello" in out.getvalue()
    # outside train_check the lines are ordinary output again
    shown = io.StringIO()
    plain = LiveOutput([0], stdout=shown, stderr=io.StringIO(), live=False)
    plain.feed([(0, "stdout", f"{LIVE_PREFIX}x{LIVE_SUFFIX}\n")])
    plain.flush(final=True)
    assert "tplab-train" in shown.getvalue()


def test_every_live_redraw_is_sent_to_the_page():
    """The Output widget syncs `outputs` only when the new value differs from the old one
    (traitlets): a bundle refilled in place compared equal to itself, and the page kept the
    first, empty figure until the end."""
    pytest.importorskip("ipywidgets")
    from tplab.checks.train_live import LiveTraining

    view = LiveTraining(2, torch.tensor([3.0, 2.5, 2.0]), {"param": [1e-5] * 4}, widget=True)
    sent = []
    view.output.observe(lambda change: sent.append(change["new"]), "outputs")
    for step in (1, 2):
        view.rows[step - 1]["losses"] = [3.0 - step / 10] * 2
        view.seen = step
        view.redraw()
    assert len(sent) == 2
    curves = [o[0]["data"]["application/vnd.plotly.v1+json"]["data"][1]["y"] for o in sent]
    assert curves == [[2.9], [2.9, 2.8]]  # what the page got at each redraw, rank 0's curve


def test_the_live_band_is_drawn_once_its_run_in_the_background_is_done():
    import concurrent.futures
    import json

    from tplab.checks.train_live import LiveTraining

    band = concurrent.futures.Future()
    view = LiveTraining(2, torch.tensor([3.0, 2.5]), band, widget=False)
    view.redraw()
    n = 1 + 2  # the reference, then a curve per rank, then the band
    drawn = view.bundle()["application/vnd.plotly.v1+json"]["data"]
    assert drawn[n]["y"] == [None]  # not measured yet (null in the page's JSON)
    json.dumps(view.bundle(), allow_nan=False)  # what a kernel sends must be strict JSON
    band.set_result({"param": [1e-5, 2e-5, 3e-5]})
    view.seen = 2
    view.redraw()
    drawn = view.bundle()["application/vnd.plotly.v1+json"]["data"]
    assert list(drawn[n]["y"]) == [2e-5, 3e-5]


def test_a_cancelled_one_device_run_stops_between_steps():
    import threading

    from tplab.checks.train import run_reference
    from tplab.errors import LabError

    cancel = threading.Event()
    cancel.set()
    calls = []
    with pytest.raises(LabError, match="cancelled"):
        run_reference(torch.nn.Linear(2, 2), lambda i: calls.append(i) or torch.ones(1, 2), 5,
                      None, None, lambda out, batch: out.sum(), cancel=cancel)
    assert calls == []
