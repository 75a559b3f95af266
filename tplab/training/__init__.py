"""Training runs under tensor parallelism, checked step by step against one device.

Rank side (loaded with the package; what a rank's own training step may call):
- `clip_grad_norm` / `grad_norm` (clip.py): Megatron-LM's TP-aware gradient clipping for
  hand-written models whose parameters are plain local shards.
- `ReductionOrder`, `ReorderedProducts` (noise.py): a legitimate other reduction order (of
  the forward's products; of every product, forward and backward: what the band measures).

Notebook side (loaded on first use, so a rank that imports tplab.training loads no plotly):
- `train_check` (check.py): the user's own training step on the ranks (their half is
  tplab/rank/train_step.py) and on one device; a report of every step against a measured
  noise band.
- `TrainReport` (report.py): ok, first_bad_step, diverged, rows, figure().
"""

from __future__ import annotations

import importlib

from tplab.training.clip import clip_grad_norm, grad_norm
from tplab.training.noise import ReductionOrder, ReorderedProducts

_NOTEBOOK_SIDE = {"train_check": "tplab.training.check", "TrainReport": "tplab.training.report"}

__all__ = ["ReductionOrder", "ReorderedProducts", "TrainReport", "clip_grad_norm", "grad_norm",
           "train_check"]


def __getattr__(name: str):
    if name not in _NOTEBOOK_SIDE:
        raise AttributeError(f"module 'tplab.training' has no attribute {name!r}")
    return getattr(importlib.import_module(_NOTEBOOK_SIDE[name]), name)
