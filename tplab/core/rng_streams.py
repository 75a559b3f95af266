"""Megatron-LM's pair of random streams for a TP group (`RNGTracker`) and the dropout that
draws from them (`Dropout`): the leaf that models and plans both build on. `tplab.rng` says
why and gives the plan-side helpers (use_tracker, reference_tracker, parallelize)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tplab.mesh import split, tp_group

REGIONS = ("replicated", "tp")
OFFSET = 2718   # Megatron-LM: tensor_model_parallel_seed = seed + 2718 + tp_rank


class RNGTracker:
    """Two random streams for a TP group: `replicated` (the same `seed` on every rank) and
    `tp` (seed + offset + tp_rank). `mesh=None` is one device (tp rank 0 of 1), or with
    `tp=n` one device that draws "tp" masks as n ranks would (see the module doc).
    `sequence_parallel=True` (ranks only): "replicated" masks are drawn for the whole
    sequence (dim 1 times tp) and each rank keeps its own shard of it."""

    def __init__(self, mesh=None, seed: int = 1234, offset: int = OFFSET, *,
                 tp: int | None = None, sequence_parallel: bool = False):
        if mesh is None:
            self.size, self.rank = (tp or 1), None
            if not isinstance(self.size, int) or self.size < 1:
                raise ValueError(f"tp must be a positive int, got {tp!r}")
            if sequence_parallel:
                raise ValueError("sequence_parallel=True needs the ranks' mesh: one device "
                                 "holds the whole sequence")
        else:
            if tp is not None:
                raise ValueError("tp= is for one device (mesh=None); the mesh gives the ranks'")
            _, self.size, self.rank = tp_group(mesh)
        # data parallel (a 2-D mesh): replica d holds slice d of the batch, and draws the
        # same slice of the whole batch's masks
        self.dp, self.dp_rank = 1, 0
        if mesh is not None and "dp" in (getattr(mesh, "mesh_dim_names", None) or ()):
            self.dp, self.dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
        self.seed, self.offset = seed, offset
        self.sequence_parallel = bool(sequence_parallel)
        self.replicated = torch.Generator().manual_seed(seed)
        # every rank keeps every rank's stream, and picks its own (see the module doc)
        self.tp = [torch.Generator().manual_seed(seed + offset + r) for r in range(self.size)]

    def rand(self, shape, region: str = "replicated", dim: int = -1) -> torch.Tensor:
        """Uniform [0, 1) numbers of `shape` (this rank's local shape) from the stream of
        `region`. `dim`: the dim a TP region shards (used by one device emulating tp>1).
        On a (dp, tp) mesh dim 0 is this replica's slice of the batch."""
        if region not in REGIONS:
            raise ValueError(f"region must be one of {REGIONS}, not {region!r}")
        shape = tuple(shape)
        if self.dp > 1 and shape:
            whole = self._rand((shape[0] * self.dp, *shape[1:]), region, dim)
            return _mine(whole, self.dp, self.dp_rank, 0)
        return self._rand(shape, region, dim)

    def _rand(self, shape: tuple, region: str, dim: int) -> torch.Tensor:
        with rank_free_randomness():
            if region == "replicated" and not self.sequence_parallel:
                return torch.rand(shape, generator=self.replicated)
            if region == "replicated":  # the whole sequence's mask; keep this rank's shard
                if len(shape) < 2:
                    raise ValueError("under sequence parallelism dropout expects (batch, "
                                     f"sequence shard, ...) activations, got shape {shape}")
                whole = (shape[0], shape[1] * self.size, *shape[2:])
                mask = torch.rand(whole, generator=self.replicated)
                dim_of_mine = 1
            elif self.rank is None:  # one device: rank r's chunk from rank r's stream
                d = dim % len(shape) if shape else 0
                if self.size > 1 and (not shape or shape[d] % self.size):
                    raise ValueError(f"a 'tp' dropout on dim {dim} of shape {shape} does not "
                                     f"split into tp={self.size} chunks")
                chunk = (*shape[:d], shape[d] // self.size, *shape[d + 1:]) if shape else ()
                return torch.cat([torch.rand(chunk, generator=g) for g in self.tp], d) \
                    if shape else torch.rand((), generator=self.tp[0])
            else:
                mask = torch.stack([torch.rand(shape, generator=g) for g in self.tp])
                dim_of_mine = 0
        # outside rank_free_randomness: the rank's index must hold every simulated rank's
        mine = _mine(mask, self.size, self.rank, dim_of_mine)
        return mine if dim_of_mine else mine[0]


def rank_free_randomness():
    """A context in which random ops give the same values on every (simulated) rank: outside
    `tplab.simulate`'s LocalTensorMode (torch.distributed._local_tensor), where a random op
    would draw each simulated rank's own values."""
    lt = sys.modules.get("torch.distributed._local_tensor")
    return lt.maybe_disable_local_tensor_mode() if lt is not None else contextlib.nullcontext()


def _mine(x: torch.Tensor, size: int, rank, dim: int) -> torch.Tensor:
    """This rank's chunk of x on dim (see tplab.mesh.split: works in tplab.simulate)."""
    return split(x, size, rank, dim)


class Dropout(nn.Module):
    """Dropout whose mask comes from an `RNGTracker` stream: `region="replicated"` outside
    the TP regions (the same mask on every rank), `"tp"` inside them (a mask of its own on
    each rank). Inverted dropout, as `torch.nn.Dropout`: kept values are scaled by 1/(1-p).
    `tracker` defaults to one device's; `use_tracker` gives a parallel model the ranks'.
    `dim`: for `region="tp"`, the dim the TP region shards (the heads' or hidden units').
    """

    def __init__(self, p: float = 0.1, region: str = "replicated",
                 tracker: RNGTracker | None = None, dim: int = -1):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if region not in REGIONS:
            raise ValueError(f"region must be one of {REGIONS}, not {region!r}")
        self.p, self.region, self.dim = p, region, dim
        self.tracker = tracker or RNGTracker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if isinstance(x, DTensor):
            raise TypeError("rng.Dropout takes local tensors, got a DTensor: give the layer "
                            "before it use_local_output=True (the lab's plans do)")
        keep = self.tracker.rand(x.shape, self.region, self.dim) >= self.p
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region!r}"
