"""Targets for `python -m tplab check` in tests/test_cli_check.py (imported by name)."""

from __future__ import annotations

import functools

from tplab import megatron, models

CFG = models.Config(dim=16, hidden_dim=32, n_heads=4, seq_len=4, batch_size=2)
build = functools.partial(models.MLP, CFG)
make_input = functools.partial(models.make_input, CFG)
broken = functools.partial(megatron.parallelize, reduce_grad=False)


def loss(out):
    return out.sum()
