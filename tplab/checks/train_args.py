"""train_check's arguments, checked in the notebook before anything runs: each mistake a
TypeError or ValueError that names the argument, its value and what is allowed."""

from __future__ import annotations

import torch

from tplab.errors import LabError
from tplab.lab.contract import Ranks
from tplab.losses import DP_REDUCTIONS

__all__ = ["check_args", "check_options"]


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
