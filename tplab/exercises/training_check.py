"""Exercise "clip_grad" (lesson 12), notebook side: the answer trains a TinyLM under the
hand-written Megatron path on the ranks, and `tplab.train_check` judges it step by step
against one device clipped by torch's own `clip_grad_norm_` (`clipping.judged`)."""

from __future__ import annotations

import functools

import tplab
from tplab import megatron, models
from tplab.core.answers import clipping
from tplab.errors import CellTimeout, LabError, RankError
from tplab.exercises.feedback import fail
from tplab.training import lm, steps

STEPS = 2


def check_clip(name, answer, lab):
    if not callable(answer):
        raise fail(name, f"the answer is a function clip(model, max_norm), not {answer!r}")
    if lab.world_size < 2:
        raise fail(name, "a lab of 1 rank has nothing to split, so it cannot tell a right "
                         "answer from a wrong one: use tplab.launch(2) or tplab.simulate(2)")
    cfg = models.Config(vocab_size=8 * lab.world_size, dim=4 * lab.world_size, n_layers=1,
                        n_heads=lab.world_size, hidden_dim=8 * lab.world_size, seq_len=4,
                        batch_size=2)
    step = functools.partial(steps.lm_step, max_norm=0.05,
                             clip=functools.partial(clipping.judged, answer=answer))
    try:
        report = tplab.train_check(lab, functools.partial(models.TinyLM, cfg),
                                   megatron.parallelize, lm.counting_batches(cfg),
                                   steps=STEPS, step=step, make_optimizer=steps.sgd,
                                   live=False)
    except CellTimeout:
        raise  # the time limit: `exercises.check` says so
    except RankError as err:
        last = next(iter(err.tracebacks.values())).strip().splitlines()[-1]
        raise fail(name, f"your clip raised an exception on the ranks: {last}") from None
    except (LabError, TypeError, ValueError, RuntimeError) as err:
        raise fail(name, f"your clip raised an exception: {type(err).__name__}: {err}") from None
    if report.ok:
        return (f"right: {STEPS} clipped SGD steps on {lab.world_size} ranks stay within the "
                f"noise band of one device")
    row = report.rows[report.first_bad_step - 1] if report.first_bad_step else report.rows[0]
    if row["replica_spread"] > row["param_band"]:
        raise fail(name, f"at step {report.first_bad_step} {row['spread_param']} differs "
                         f"across ranks by {row['replica_spread']:.2g}: each rank clipped by "
                         "its own norm. The norm is the whole model's: all-reduce the sharded "
                         "gradients' squared norms over the tp group")
    raise fail(name, f"at step {report.first_bad_step} the ranks agree with each other but "
                     f"not with one device ({report.detail}): the norm is off. Is every "
                     "parameter counted once? The replicated ones (the norms' weights) are on "
                     "every rank: add their squares once, after the all-reduce")
