"""Training under tensor parallelism, both sides: what a rank's own training step may call
and what one device runs as its reference. `tplab.train_check`, which runs them on the
ranks and on one device and judges every step, is the notebook's: tplab/checks/train.py.

- `clip_grad_norm` / `grad_norm` (clip.py): Megatron-LM's TP-aware gradient clipping for
  hand-written models whose parameters are plain local shards.
- `ReductionOrder`, `ReorderedProducts` (noise.py): a legitimate other reduction order (of
  the forward's products; of every product, forward and backward: what the band measures).
- `lm` (DropoutLM and its data), `steps` (training steps and optimizers, right and wrong).
"""

from __future__ import annotations

from tplab.training.clip import clip_grad_norm, grad_norm
from tplab.training.noise import ReductionOrder, ReorderedProducts

__all__ = ["ReductionOrder", "ReorderedProducts", "clip_grad_norm", "grad_norm"]
