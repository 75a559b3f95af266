"""Training steps and optimizers for language models, right and wrong: what lesson 12 and
the tests hand to `tplab.train_check` (each runs unchanged on one device and on the ranks).

- `lm_step`: forward, next-token loss, backward, clipping, `optimizer.step()`,
  `zero_grad()`. `clip=clip_grad_norm` (TP-aware, the default) or `clip=per_rank_clip`
  (torch's `clip_grad_norm_` on plain local shards: each rank clips by its own norm).
- `decay_matrices`: AdamW with weight decay on matrices only (by `ndim`, which a shard
  keeps); `decay_by_size`: the same chosen by `numel()`, which a plain shard divides by
  tp, so the ranks decay fewer weights than one device does.
- `sgd`: SGD with momentum, under which a clipping factor shows at once.
"""

from __future__ import annotations

import functools

import torch

from tplab.losses import loss_context
from tplab.models import lm_loss
from tplab.training.clip import clip_grad_norm


def per_rank_clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The bug: torch's clip_grad_norm_ on a model whose parameters are plain shards."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def lm_step(model, optimizer, tokens, max_norm: float | None = 0.5, clip=clip_grad_norm):
    """One step of next-token prediction (`tplab.models.lm_loss`; under `loss_parallel()`
    for vocab-sharded logits), clipped to `max_norm` by `clip(model, max_norm)`."""
    logits = model(tokens)
    with loss_context({"logits": logits}):
        loss = lm_loss(logits, tokens)
        loss.backward()
    if max_norm is not None:
        clip(model, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def per_rank_clipped_step(max_norm: float = 0.5):
    """`lm_step` with the per-rank clipping bug."""
    return functools.partial(lm_step, max_norm=max_norm, clip=per_rank_clip)


def sgd(params, lr: float = 0.1, momentum: float = 0.9):
    """SGD with momentum: an update proportional to the gradient, so a clipping factor shows
    in every weight (Adam divides it out: m / sqrt(v) does not change when every gradient
    is scaled alike, so per-rank clipping hides under Adam until the factors vary)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def decay_matrices(params, lr: float = 1e-3, weight_decay: float = 0.1):
    """AdamW, weight decay on matrices (ndim >= 2) only: norms and biases are not decayed."""
    params = list(params)
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def decay_by_size(params, lr: float = 1e-3, weight_decay: float = 0.1, min_numel: int = 256):
    """The bug: weight decay for tensors of at least `min_numel` elements. A plain shard
    holds numel / tp of them, so a matrix decayed on one device is not on the ranks
    (a DTensor's numel() is the whole tensor's: DTensor plans do not have this bug)."""
    params = list(params)
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.numel() >= min_numel],
          "weight_decay": weight_decay},
         {"params": [p for p in params if p.numel() < min_numel], "weight_decay": 0.0}],
        lr=lr)
