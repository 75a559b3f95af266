"""Activation checkpointing under TP: tplab.rng's dropout masks survive the recomputation.

The truth is one device: a model whose blocks are checkpointed must give exactly the
gradients of the same model without checkpointing (the same masks, the same network).
torch's checkpoint alone restores only the default generator, so tplab.rng's streams redraw
other masks in the recomputation (the bug `masks="redraw"` plants); `keep_masks` restores
them. Under TP (world 4, processes) train_check passes the first and catches the second at
its first step, on TP alone and under FSDP2 x TP.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

import tplab
from tplab import checkpointing, fsdp, megatron, models, plans, rng
from tplab.training import lm, steps

CFG = models.Config(vocab_size=32, dim=16, n_layers=2, n_heads=4, hidden_dim=32, seq_len=8,
                    batch_size=4)
DROPPY = functools.partial(lm.DropoutLM, CFG, 0.1)
BATCHES = lm.counting_batches(CFG)
STEP = functools.partial(steps.lm_step, max_norm=0.5)
MEG = functools.partial(rng.parallelize, plan=megatron.parallelize, seed=1234)
DT = functools.partial(rng.parallelize, plan=plans.lm(), seed=1234)


def _grads(model, tokens):
    torch.manual_seed(0)  # torch's own generator: what torch's checkpoint does restore
    models.lm_loss(model(tokens), tokens).backward()
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("masks", ["keep", "redraw"])
def test_on_one_device_a_checkpointed_block_recomputes_the_same_masks_only_when_kept(masks):
    tokens = models.make_tokens(CFG)
    plain = DROPPY()
    wrapped = DROPPY()
    wrapped.load_state_dict(plain.state_dict())
    checkpointing.checkpoint_blocks(wrapped, ("Block",), masks)
    assert all(isinstance(layer, CheckpointWrapper) for layer in wrapped.layers)
    want, got = _grads(plain, tokens), _grads(wrapped, tokens)
    same = all(torch.equal(want[n], got[n]) for n in want)
    assert same == (masks == "keep")
    # and the streams move on as far as the forward moved them: the next masks are the same
    a = plain.embedding_dropout.tracker.rand((8,))
    b = wrapped.embedding_dropout.tracker.rand((8,))
    assert torch.equal(a, b) == (masks == "keep")


def test_checkpoint_blocks_says_when_nothing_matches():
    with pytest.raises(tplab.PlanError, match="no submodule of DropoutLM is a Decoder"):
        checkpointing.checkpoint_blocks(DROPPY(), ("Decoder",))
    with pytest.raises(tplab.PlanError, match="masks is 'keep' or 'redraw'"):
        checkpointing.checkpoint_blocks(DROPPY(), masks="maybe")


PLANS = {
    "hand-written TP": (MEG, None),
    "DTensor TP": (DT, None),
    "FSDP2 x hand-written TP": ("fsdp", MEG),
}


def _plan(name, masks):
    plan, inner = PLANS[name]
    if plan == "fsdp":
        ac = functools.partial(checkpointing.checkpointed, plan=inner, masks=masks)
        return fsdp.fsdp_tp(ac, per_module=("Block",)), 2
    return functools.partial(checkpointing.checkpointed, plan=plan, masks=masks), None


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_train_check_passes_kept_masks_and_catches_redrawn_ones_at_step_1(labs, name):
    lab = labs.get(4)
    plan, dp = _plan(name, "keep")
    kept = tplab.train_check(lab, DROPPY, plan, BATCHES, steps=3, step=STEP, dp=dp, live=False)
    assert kept.ok, str(kept)
    plan, dp = _plan(name, "redraw")
    redrawn = tplab.train_check(lab, DROPPY, plan, BATCHES, steps=3, step=STEP, dp=dp,
                                live=False)
    assert not redrawn.ok and redrawn.first_bad_step == 1, str(redrawn)
