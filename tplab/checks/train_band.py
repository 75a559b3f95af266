"""The noise band: how far a correct run may drift from one device, measured.

The reference (one device) runs twice: once plainly, once under `ReorderedProducts(tp)`
(every matrix product, forward and backward, as tp partial sums added in another order:
tplab/training/noise.py), on the same batches from the same RNG state. Both are correct;
their difference at step i is what reduction order alone does by then (and what the
optimizer makes of it).
The band at step i is FACTOR times the largest such difference up to step i (so it only
grows with the step), plus a floor of a few units in the last place of the values
compared (a run whose products do not split still rounds somewhere).

FACTOR: a TP run splits its sums differently from the noise run (over ranks, in the
collective's order), so its drift is of the same size but not the same number. Measured
here (TinyLM and tplab.training.lm.DropoutLM, TP, SP, hand-written and DTensor, world 2
and 4): correct runs stayed below 0.1 x the band (1 x the measured noise); every bug of
lesson 12 was 10^3 to 10^4 x outside it from its first bad step (tests/test_training.py).
A run that explodes (tests/verdict_draws.py, benchmarks/verdicts.py seed 0 draw 423: SGD
with momentum on a sum loss, the loss 20 -> 2e5 in 3 steps) amplifies the two runs'
rounding by different factors: its ranks drifted 10 x its noise run, so FACTOR is 30.
"""

from __future__ import annotations

import torch

FACTOR = 30.0
ULPS = 16.0


def running_max(values: list[float]) -> list[float]:
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def noise_band(ref_losses: torch.Tensor, noise_losses: torch.Tensor,
               ref: dict[str, torch.Tensor], noise: dict[str, torch.Tensor]) -> dict:
    """{"loss": [band of step 1..n], "param": [band of step 0..n], "loss_noise",
    "param_noise"}: from the plain and the reordered reference runs (tensors of losses,
    and {name: [steps + 1, *shape]} parameter trajectories)."""
    steps = len(ref_losses)
    eps = torch.finfo(ref_losses.dtype).eps
    loss_noise = (noise_losses.double() - ref_losses.double()).abs().tolist()
    param_noise, scale = [0.0] * (steps + 1), [0.0] * (steps + 1)
    for name, traj in ref.items():
        if not traj.numel():
            continue
        d = (noise[name].double() - traj.double()).abs().flatten(1).amax(1).tolist()
        s = traj.double().abs().flatten(1).amax(1).tolist()
        param_noise = [max(a, b) for a, b in zip(param_noise, d, strict=True)]
        scale = [max(a, b) for a, b in zip(scale, s, strict=True)]
    p_eps = max((torch.finfo(t.dtype).eps for t in ref.values() if t.is_floating_point()),
                default=eps)
    loss_band = [FACTOR * m + ULPS * eps * abs(v)
                 for m, v in zip(running_max(loss_noise), ref_losses.tolist(), strict=True)]
    param_band = [FACTOR * m + ULPS * p_eps * s
                  for m, s in zip(running_max(param_noise), scale, strict=True)]
    return {"loss": loss_band, "param": param_band, "loss_noise": loss_noise,
            "param_noise": param_noise}
