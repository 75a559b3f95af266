"""Training runs under tensor parallelism, checked step by step against one device.

- `train_check` (tplab/training/check.py): the user's own training step on the ranks and on
  one device; a report of every step against a measured noise band.
- `TrainReport` (report.py): ok, first_bad_step, diverged, rows, figure().
- `clip_grad_norm` / `grad_norm` (clip.py): Megatron-LM's TP-aware gradient clipping for
  hand-written models whose parameters are plain local shards.
- `ReductionOrder` (noise.py): a legitimate other reduction order, what the band measures.
"""

from tplab.training.check import train_check
from tplab.training.clip import clip_grad_norm, grad_norm
from tplab.training.noise import ReductionOrder
from tplab.training.report import TrainReport

__all__ = ["ReductionOrder", "TrainReport", "clip_grad_norm", "grad_norm", "train_check"]
