"""The noise of a legitimate reduction order: what `train_check`'s band is measured from.

Two correct runs of the same training differ in their last digits: floating-point addition
is not associative, and a TP run adds the same products in another order (a row-parallel
layer sums tp partial products with an all-reduce; Megatron-LM and DTensor add them in
whatever order the collective does). Over many steps the optimizer amplifies those
differences (training is chaotic), so a correct run drifts away from one device by more
than one step's rounding.

`ReductionOrder(parts)` measures that drift on one device: inside it, every matrix product
(`F.linear`, `torch.matmul` and `@`) is computed as `parts` partial products over its
contraction dim, added last-first, which is a row-parallel layer's sum over tp ranks in
another order. The result is the same up to rounding, so running the reference once
plainly and once under it gives the spread that reduction order alone makes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def _reversed_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[-1]
    for p in reversed(parts[:-1]):
        total = total + p
    return total


class ReductionOrder(TorchFunctionMode):
    """Matrix products as `parts` partial sums over the contraction dim, added in reverse
    (see the module doc). A product whose contraction dim does not split into `parts` is
    left as it is."""

    def __init__(self, parts: int = 2):
        super().__init__()
        if not isinstance(parts, int) or parts < 2:
            raise ValueError(f"parts must be an int >= 2, got {parts!r}")
        self.parts = parts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        n = self.parts
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.shape[-1] % n == 0 and w.shape[-1] >= n:
                out = _reversed_sum([F.linear(xi, wi) for xi, wi in
                                     zip(x.chunk(n, -1), w.chunk(n, -1), strict=True)])
                return out if bias is None else out + bias
        elif func in _MATMULS and len(args) == 2 and not kwargs:
            a, b = args
            if a.ndim >= 1 and b.ndim >= 2 and a.shape[-1] % n == 0 and a.shape[-1] >= n:
                return _reversed_sum([torch.matmul(ai, bi) for ai, bi in
                                      zip(a.chunk(n, -1), b.chunk(n, -2), strict=True)])
        return func(*args, **kwargs)
