"""Targets for `python -m tplab check` in tests/test_cli_check.py (imported by name)."""

from __future__ import annotations

import functools
import sys

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tplab import megatron, models

CFG = models.Config(dim=16, hidden_dim=32, n_heads=4, seq_len=4, batch_size=2)
build = functools.partial(models.MLP, CFG)
make_input = functools.partial(models.make_input, CFG)
broken = functools.partial(megatron.parallelize, reduce_grad=False)


def build_bf16():
    return models.MLP(CFG).to(torch.bfloat16)


def make_input_bf16():
    return models.make_input(CFG).to(torch.bfloat16)


def loss(out):
    return out.sum()


# --- bad arguments (exit status 2) and failing user code (exit status 1) -----------------

not_callable = 5
plan_list = [ColwiseParallel(), RowwiseParallel()]
plan_int = 4
plan_strings = {"w1": "colwise", "w2": "rowwise"}  # transformers' words, not styles
plan_int_key = {1: ColwiseParallel()}
colwise_twice = {"w1": ColwiseParallel(), "w2": ColwiseParallel()}  # layouts do not chain


def plan_three_args(model, mesh, extra):
    return model


def plan_factory_of_a_list():
    return [ColwiseParallel()]


def plan_exits(model, mesh):
    sys.exit(0)


def build_raises():
    raise RuntimeError("no weights here")


def loss_int(out):
    return 3


def loss_not_scalar(out):
    return out.sum(-1)


def step_two_args(model, batch):  # a step is (model, optimizer, batch)
    return model(batch).sum()
