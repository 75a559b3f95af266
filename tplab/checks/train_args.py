"""train_check's arguments, checked in the notebook before anything runs: each mistake a
TypeError or ValueError that names the argument, its value and what is allowed; and what
the run itself must allow (its memory, torch's dropout under tplab.simulate, a one-device
loss that stays finite)."""

from __future__ import annotations

import torch

from tplab.errors import LabError
from tplab.lab.contract import Ranks
from tplab.losses import DP_REDUCTIONS

__all__ = ["MEMORY_LIMIT", "TORCH_DROPOUTS", "bound_memory", "check_args", "check_options",
           "refuse_non_finite", "refuse_torch_dropout"]


def check_args(lab, steps, make_batch, step, make_optimizer, loss_fn, build_model, live):
    """A TypeError or ValueError naming the argument of train_check that is wrong."""
    if not isinstance(lab, Ranks):
        raise TypeError(f"train_check: lab must be a Lab (tplab.launch(2)) or a Simulation "
                        f"(tplab.simulate(2)), got {lab!r}")
    if lab.closed:
        raise LabError("train_check: this lab was shut down; start a new one")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"train_check: steps must be a positive int, got {steps!r}")
    if isinstance(build_model, torch.nn.Module):
        raise TypeError(f"train_check: build_model must be a function that builds the model "
                        f"(every rank builds its own), got a {type(build_model).__name__} "
                        "instance: pass its class, functools.partial(Class, config), or a "
                        "function that returns a new model")
    for name, fn in (("build_model", build_model), ("make_batch", make_batch)):
        if not callable(fn):
            raise TypeError(f"train_check: {name} must be callable, got {fn!r}")
    for name, fn in (("step", step), ("make_optimizer", make_optimizer), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"train_check: {name} must be callable or None, got {fn!r}")
    if step is not None and loss_fn is not None:
        raise ValueError("train_check: loss_fn is for the default step; your step computes "
                         "its own loss (drop loss_fn=, or drop step=)")
    if live not in (None, True, False):
        raise TypeError(f"train_check: live must be True, False or None, got {live!r}")


def check_options(context, dp_reduction, param_map) -> None:
    """train_check's options for frameworks and pairing, as grad_check checks them."""
    if context is not None and not callable(context):
        raise TypeError(f"train_check: context must be a function of no arguments that "
                        f"returns a context manager, got {type(context).__name__} {context!r}")
    if dp_reduction not in DP_REDUCTIONS:
        raise ValueError(f"train_check: dp_reduction={dp_reduction!r}: one of "
                         f"{', '.join(map(repr, DP_REDUCTIONS))}")
    if param_map is not None and not isinstance(param_map, dict):
        raise TypeError("train_check: param_map is a dict {parallel name: reference name}")


MEMORY_LIMIT = 2 * 2**30  # bytes of one-device trajectories train_check keeps (see below)


def bound_memory(model, steps: int) -> None:
    """The ranks compare every step with the one-device parameters of that step, so those
    of every step are kept (twice: the band's run too). Refuse a run past MEMORY_LIMIT
    before it starts, saying how many steps fit."""
    per_step = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    if per_step * (steps + 1) > MEMORY_LIMIT:
        fit = max(MEMORY_LIMIT // max(per_step, 1) - 1, 1)
        gib = per_step * (steps + 1) / 2**30
        raise ValueError(f"train_check: steps={steps} would keep {gib:.3g} GiB of one-device "
                         f"parameters (every step's, twice: the ranks are "
                         f"compared with each step), over its limit of "
                         f"{MEMORY_LIMIT / 2**30:g} GiB; check at most {fit} steps")


TORCH_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                  torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def refuse_torch_dropout(lab: Ranks, model) -> None:
    """tplab.simulate's ranks draw every random op per rank (LocalTensorMode), so torch's
    own dropout there cannot draw one device's masks: say so, rather than fail a run."""
    if not lab.in_process:
        return
    for name, m in model.named_modules():
        if isinstance(m, TORCH_DROPOUTS) and m.p > 0 and m.training:
            raise LabError(f"train_check: {name} is torch's {type(m).__name__}, which draws "
                           "its mask from the global RNG, and tplab.simulate's ranks draw "
                           "that per rank. Use tplab.rng.Dropout (region='replicated' outside "
                           "the TP regions, 'tp' inside them) or check on rank processes "
                           "(tplab.launch)")


def refuse_non_finite(losses: torch.Tensor) -> None:
    """A one-device run that overflows has nothing to be compared with: say where."""
    bad = (~torch.isfinite(losses)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise LabError(f"train_check: the one-device run's loss is {float(losses[i])} at step "
                       f"{i + 1}: the training itself diverges there, so no run can be "
                       "compared with it (lower the learning rate, or check fewer steps)")
