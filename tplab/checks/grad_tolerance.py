"""grad_check's tolerances: relative to each tensor's scale, as torch.testing judges.

`torch.testing.assert_close` passes an element when |actual - expected| <= atol + rtol *
|expected|: rtol carries the comparison, atol is a floor for what is near zero. grad_check
judges a tensor by its largest error against `atol + rtol * max|reference|` of that tensor
(rounding in a TP run is relative to the largest terms of a tensor, not to each element),
so a tensor of gradients about 1e-3 is judged at its own scale.

The floor: an `atol=` given is absolute, as torch.testing's. By default it is relative to
the check's own scale, FLOORS[dtype] x the largest max|reference| among the tensors of the
same kind (outputs, input gradients, parameter gradients): "near zero" means near zero
next to the model's own gradients, so a loss divided by a token count (gradients of 1e-6)
is judged as strictly as one that is not, and a 0.5% error in any tensor above 2e-4 of the
largest of its kind is flagged (float32).
"""

from __future__ import annotations

import math

import torch

from tplab.errors import LabError

__all__ = ["FLOORS", "TOLERANCES", "check_tolerance", "kind_floors", "tolerances"]

# (atol, rtol) by the dtype the model computes in, as torch.testing.assert_close picks its
# defaults by dtype: atol is what a given atol= replaces, rtol the relative tolerance.
# float32's rtol is grad_check's own (measured here, TinyLM, MLP, Block, TP and DTensor
# plans, world 2 and 4, dp 1 and 2: up to 9e-7 of a tensor's own largest value; every bug
# of the lessons is O(1), and a 0.5% error is 50 x rtol); the half types' keep about the
# same ratio to what their rounding makes (bfloat16 up to 0.031, float16 up to 0.004).
TOLERANCES = {torch.float64: (1e-5, 1e-4), torch.float32: (1e-5, 1e-4),
              torch.float16: (1e-4, 2e-2), torch.bfloat16: (1e-3, 1e-1)}
# the default floor, as a fraction of the largest max|reference| of a row's kind: a few
# ulps of the largest terms (what a tensor near zero computed from them keeps of rounding)
FLOORS = {torch.float64: 1e-6, torch.float32: 1e-6, torch.float16: 1e-4,
          torch.bfloat16: 1e-3}


def check_tolerance(value, name: str, who: str = "grad_check") -> float | None:
    """`atol=`/`rtol=` as a float: None stays None (the default); a number, or a numeric
    string as a config file gives it ("1e-5", converted as the CLI's --atol is), must be
    finite and >= 0. Anything else is a LabError naming the argument: a negative or nan
    tolerance judges every row wrong, an infinite one passes every bug."""
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise LabError(f"{who}: {name}={given!r} is not a number; give a float such as "
                           f"{name}=1e-5 (or None for the default)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LabError(f"{who}: {name} must be a float >= 0 (or None for the default), got "
                       f"{type(given).__name__} {given!r}")
    if not math.isfinite(value) or value < 0:
        raise LabError(f"{who}: {name}={given!r} must be a finite number >= 0: a negative or "
                       "nan tolerance judges every row wrong, an infinite one passes every "
                       "bug")
    return float(value)


def tolerances(tensors, atol: float | None, rtol: float | None):
    """(atol, rtol, dtype): those given (checked by `check_tolerance`), else the defaults of
    the least precise floating dtype among `tensors` (the model's parameters and outputs:
    what it computes in); atol None when it is not given (the floor is FLOORS[dtype] of
    each kind's scale: `kind_floors`)."""
    atol, rtol = check_tolerance(atol, "atol"), check_tolerance(rtol, "rtol")
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    default = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    return atol, default[1] if rtol is None else rtol, dtype


def kind_floors(references: dict[str, list], atol: float | None, dtype) -> dict[str, float]:
    """{row kind: absolute floor}: `atol` for every kind when given, else FLOORS[dtype] x
    the largest max|reference| among that kind's tensors (`references`: {kind: tensors})."""
    present = {kind: [t for t in tensors if isinstance(t, torch.Tensor) and t.numel()]
               for kind, tensors in references.items()}
    present = {kind: tensors for kind, tensors in present.items() if tensors}
    if atol is not None:
        return dict.fromkeys(present, atol)
    factor = FLOORS.get(dtype, FLOORS[torch.float32])
    return {kind: factor * max(float(t.detach().abs().max()) for t in tensors)
            for kind, tensors in present.items()}
