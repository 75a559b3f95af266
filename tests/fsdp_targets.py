"""Targets for `python -m tplab check ... --dp 2` in tests/test_fsdp.py (imported by name)."""

from __future__ import annotations

import functools

import tplab
from tplab import fsdp, models, plans

CFG = models.Config(dim=16, hidden_dim=32, n_heads=4, seq_len=4, batch_size=4)
build = functools.partial(models.MLP, CFG)
make_input = functools.partial(models.make_input, CFG)
fsdp_tp = fsdp.fsdp_tp(plans.mlp())  # TP on mesh["tp"], FSDP2 on mesh["dp"]
# the bug over a function that makes DTensors: refused on the ranks (over a dict, at once)
fsdp_on_tp = fsdp.fsdp_tp(functools.partial(tplab.apply_plan, plan=plans.mlp()), on="tp")


def loss(out):
    return out.pow(2).mean()
