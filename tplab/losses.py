"""The loss of a check's step, the same on both sides: the notebook's one-device reference
and every rank (grad_check, train_check, tplab.fsdp's steps, tplab.training's).

- `call_loss(loss_fn, out, x)`: `loss_fn(out, x)` or `loss_fn(out)` (by its signature), or
  the default `0.5 * sum(leaf**2)` over the output's floating tensors (its gradient is
  the output itself); a LabError for anything but a scalar.
- `loss_context(out)`: torch's `loss_parallel()` when an output is a DTensor sharded on its
  last dim (an lm head planned for loss parallelism), else nothing.
- `with_grad(x)`: the input with its floating tensors requiring grad (their gradients are
  checked too).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tplab.core.pytrees import leaves, map_tensors
from tplab.errors import LabError

__all__ = ["DP_REDUCTIONS", "LOSS_PARALLEL_LOSSES", "call_loss", "loss_context", "vocab_sharded",
           "with_grad"]

# what torch's loss_parallel() computes on vocab-sharded logits (its docstring, torch 2.13)
# how the dp replicas' losses make the one-device loss: their mean (DDP's averaged
# gradients) or their sum (torchtitan's convention: the loss divides by the global count)
DP_REDUCTIONS = ("mean", "sum")

LOSS_PARALLEL_LOSSES = ("F.cross_entropy / nn.CrossEntropyLoss with class-index targets "
                        "(reduction mean, sum or none; ignore_index; a replicated weight), "
                        "not label_smoothing, class probabilities, or any other op on the "
                        "logits (log_softmax + gather by hand, indexing, masking)")


def call_loss(loss_fn, out, x) -> torch.Tensor:
    """`loss_fn(out, x)` (or `loss_fn(out)`: by its signature), or the default loss; a
    LabError naming loss_fn when it gives anything but a scalar tensor (backward needs one:
    `torch.autograd.backward` of a non-scalar asks for grad_tensors). A loss that fails on
    vocab-sharded DTensor logits is a LabError that says so and what loss_parallel runs."""
    name = getattr(loss_fn, "__name__", repr(loss_fn))
    try:
        loss = _call_loss(loss_fn, out, x)
    except (RuntimeError, NotImplementedError, IndexError, ValueError) as e:
        sharded = vocab_sharded(out)
        if not sharded:
            raise
        raise LabError(f"loss_fn {name} failed on vocab-sharded logits: {sharded} is a "
                       f"DTensor sharded on its last (vocab) dim, so the loss runs under "
                       f"torch's loss_parallel(), which computes {LOSS_PARALLEL_LOSSES}. "
                       f"Write the loss with F.cross_entropy, or gather the logits (plan the "
                       f"lm head with output_layouts=Replicate()). ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''})") from e
    if not isinstance(loss, torch.Tensor):
        raise LabError(f"loss_fn {name} returned {type(loss).__name__} {loss!r}; it must "
                       "return a scalar tensor (such as out.sum())")
    if loss.numel() != 1:
        raise LabError(f"loss_fn {name} returned a tensor of shape {tuple(loss.shape)}; it "
                       "must return a scalar (reduce it: .sum() or .mean())")
    return loss


def _call_loss(loss_fn, out, x):
    if loss_fn is None:
        parts = [t.pow(2).sum() for _, t in leaves(out) if t.is_floating_point()]
        if not parts:
            raise LabError("grad_check: the output has no floating-point tensor for the "
                           "default loss 0.5 * sum(output**2); pass loss_fn=")
        return 0.5 * sum(parts[1:], parts[0])
    try:
        params = inspect.signature(loss_fn).parameters.values()
        two = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2
        two = two or any(p.kind is p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        two = True
    return loss_fn(out, x) if two else loss_fn(out)


def vocab_sharded(out) -> str:
    """The pytree path of the first output that is a DTensor sharded on its last dim
    ("output.logits"), or "" when there is none."""
    for path, t in leaves(out, "output"):
        if isinstance(t, DTensor) and any(
                p.is_shard() and p.dim in (-1, t.ndim - 1) for p in t.placements):
            return path
    return ""


def loss_context(out):
    """`loss_parallel()` when an output is a DTensor sharded on its last dim, else nothing."""
    return loss_parallel() if vocab_sharded(out) else contextlib.nullcontext()


def with_grad(x):
    """A copy of the input pytree whose floating-point tensors require grad (so their
    gradients are checked too; integer token ids stay as they are)."""
    return map_tensors(lambda t: t.clone().requires_grad_(t.is_floating_point())
                       if t.is_floating_point() else t.clone(), x)
