"""Randomness under tensor parallelism: Megatron-LM's RNG tracker, and a dropout that uses it.

g's identity backward (and every `Replicate()` placement) assumes that each rank computes
bit-identical values outside the TP regions: the residual stream, the norms, the loss. A
random op there breaks that silently if the ranks draw different numbers, for instance a
dropout after the attention or the MLP when every rank was seeded with its own rank: each
rank then drops different elements, the "replicated" activations differ, and nothing fails;
the replicas just drift apart (tplab.grad_check's `replica_spread` rows show it).

Megatron-LM keeps two random streams (megatron/core/tensor_parallel/random.py,
`model_parallel_cuda_manual_seed` and `CudaRNGStatesTracker`):

- the default generator, seeded with the SAME seed on every TP rank: dropout outside the TP
  regions (hidden dropout on the residual stream) draws the same mask everywhere;
- the "model-parallel-rng" stream, seeded `seed + 2718 + tp_rank`, entered with
  `get_cuda_rng_tracker().fork()`: dropout inside a TP region (on a rank's attention heads)
  draws a different mask on each rank, as the one device would on different heads.

`RNGTracker` is that pair of streams on CPU generators; `Dropout(p, region)` draws its mask
from the stream of its region ("replicated" or "tp"). Masks are drawn with rank-dependent
randomness switched off and every rank's "tp" mask is drawn on every rank, then each rank
picks its own, so that the same code runs in processes and in `tplab.simulate`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

REGIONS = ("replicated", "tp")
OFFSET = 2718   # Megatron-LM: tensor_model_parallel_seed = seed + 2718 + tp_rank


class RNGTracker:
    """Two random streams for a TP group: `replicated` (the same `seed` on every rank) and
    `tp` (seed + offset + tp_rank). `mesh=None` is one device (tp rank 0 of 1)."""

    def __init__(self, mesh=None, seed: int = 1234, offset: int = OFFSET):
        if mesh is None:
            self.size, self.rank = 1, 0
        else:
            from tplab.megatron import tp_group

            _, self.size, self.rank = tp_group(mesh)
        self.seed, self.offset = seed, offset
        self.replicated = torch.Generator().manual_seed(seed)
        # every rank keeps every rank's stream, and picks its own (see the module doc)
        self.tp = [torch.Generator().manual_seed(seed + offset + r) for r in range(self.size)]

    def rand(self, shape, region: str = "replicated") -> torch.Tensor:
        """Uniform [0, 1) numbers of `shape` from the stream of `region`."""
        from tplab.models import rank_free_randomness

        if region not in REGIONS:
            raise ValueError(f"region must be one of {REGIONS}, not {region!r}")
        with rank_free_randomness():
            if region == "replicated":
                return torch.rand(shape, generator=self.replicated)
            draws = torch.stack([torch.rand(shape, generator=g) for g in self.tp])
        index = (torch.zeros((), dtype=torch.long) + self.rank).reshape(1)
        return draws.index_select(0, index)[0]


class Dropout(nn.Module):
    """Dropout whose mask comes from an `RNGTracker` stream: `region="replicated"` outside
    the TP regions (the same mask on every rank), `"tp"` inside them (a mask of its own on
    each rank). Inverted dropout, as `torch.nn.Dropout`: kept values are scaled by 1/(1-p).
    `tracker` defaults to one device's; `use_tracker` gives a parallel model the ranks'."""

    def __init__(self, p: float = 0.1, region: str = "replicated",
                 tracker: RNGTracker | None = None):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if region not in REGIONS:
            raise ValueError(f"region must be one of {REGIONS}, not {region!r}")
        self.p, self.region = p, region
        self.tracker = tracker or RNGTracker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = self.tracker.rand(x.shape, self.region) >= self.p
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region!r}"


def use_tracker(model: nn.Module, mesh, seed: int = 1234) -> nn.Module:
    """Give every `Dropout` of `model` the ranks' tracker for `mesh` (Megatron-LM's
    `model_parallel_cuda_manual_seed(seed)`); returns the model."""
    tracker = RNGTracker(mesh, seed)
    for m in model.modules():
        if isinstance(m, Dropout):
            m.tracker = tracker
    return model


def parallelize(model: nn.Module, mesh, plan=None, seed: int = 1234) -> nn.Module:
    """A `(model, mesh) -> model` plan for grad_check: `plan` (a dict for
    `tplab.apply_plan`, or a callable such as `tplab.megatron.parallelize`), then
    `use_tracker`. Use it as `functools.partial(rng.parallelize, plan=..., seed=...)`."""
    if plan is not None:
        if isinstance(plan, dict):
            from tplab.plans import apply_plan

            model = apply_plan(model, mesh, plan)
        else:
            model = plan(model, mesh)
    return use_tracker(model, mesh, seed)
