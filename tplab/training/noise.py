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

`ReorderedProducts(parts)` does the same at the level autograd computes in (`aten.mm`,
`aten.addmm`, `aten.bmm`), so the backward's products are reordered too: the weight
gradients' sums over tokens and the input gradients' sums over features, where a TP run
(f's all-reduce), SP and dp add in another order as well. That is the band's run: an
optimizer that amplifies rounding (Adam's first step on a gradient that cancels to near
zero) amplifies this run's rounding as it does the ranks'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


_ATEN = torch.ops.aten


class ReorderedProducts(TorchDispatchMode):
    """Every matrix product, forward AND backward, as `parts` partial sums over its
    contraction dim added last-first: `aten.mm`, `aten.addmm` and `aten.bmm`, as autograd
    calls them. The backward products are where a TP run also adds in another order (f's
    all-reduce sums the input gradient of a column-parallel layer over its shards), and
    where rounding meets the optimizer: a weight gradient that cancels to near zero keeps
    an error of eps times the terms it summed, which Adam's first step, g / (|g| + eps),
    turns into an update of up to lr. Reordering the very sums that make the gradients
    gives each element the rounding error its own terms allow, so whatever the optimizer
    does to rounding noise shows in the run this mode makes."""

    def __init__(self, parts: int = 2):
        super().__init__()
        if not isinstance(parts, int) or parts < 2:
            raise ValueError(f"parts must be an int >= 2, got {parts!r}")
        self.parts = parts

    def _split(self, a, b, k_dim_a: int, k_dim_b: int, mm):
        n = min(self.parts, a.shape[k_dim_a])
        if n < 2 or not a.is_floating_point():
            return None
        return _reversed_sum([mm(x, y) for x, y in zip(a.tensor_split(n, k_dim_a),
                                                       b.tensor_split(n, k_dim_b),
                                                       strict=True)])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if func is _ATEN.mm.default and not kwargs:
            out = self._split(args[0], args[1], 1, 0, _ATEN.mm.default)
        elif func is _ATEN.bmm.default and not kwargs:
            out = self._split(args[0], args[1], 2, 1, _ATEN.bmm.default)
        elif func is _ATEN.addmm.default and not kwargs and len(args) == 3:
            prod = self._split(args[1], args[2], 1, 0, _ATEN.mm.default)
            out = None if prod is None else prod + args[0]
        return func(*args, **kwargs) if out is None else out
