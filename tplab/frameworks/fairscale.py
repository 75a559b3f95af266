"""fairscale's model-parallel layers on the lab's ranks (both sides): the layers of Meta's
original LLaMA reference code (`fairscale.nn.model_parallel.layers`), their parallel state
brought up on the lab's mesh, their own tp = 1 build as the one-device reference.

    from tplab.frameworks import fairscale as ff
    report = tplab.grad_check(lab, ff.reference(build), ff.from_shards(build), make_input)

fairscale marks nothing on its parameters, so where each one is cut is read from LAYERS, a
table of its layer types (as `layers.py` of fairscale 0.4.13 splits them); a layer of your
own passes its table to `from_shards(build, layers={MyLayer: {"weight": 0}})`.
fairscale's layers run on the CPU as they are (they make their weights on the default
device and draw them whole on every rank, then keep their slice); its `model_parallel_cuda_
manual_seed` and RNG tracker (dropout in its model-parallel regions) use CUDA: not called.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplab.frameworks.installed import require
from tplab.frameworks.shards import (
    BuiltAt,
    FromShards,
    ParallelStates,
)

mp = require("fairscale.nn.model_parallel", "fairscale", "0.4.13")

__all__ = ["LAYERS", "SIMULATION", "from_shards", "init", "reference"]

# fairscale.nn.model_parallel.layers: which dim of each parameter a layer type splits
LAYERS: dict[type, dict[str, int | None]] = {
    mp.layers.ColumnParallelLinear: {"weight": 0, "bias": 0},  # output features
    mp.layers.RowParallelLinear: {"weight": 1, "bias": None},  # input features; bias whole
    mp.layers.VocabParallelEmbedding: {"weight": 0},  # the vocabulary
    mp.layers.ParallelEmbedding: {"weight": 1},  # the embedding dim
}

SIMULATION = (
    "fairscale does not run under tplab.simulate: it uses the rank as a plain int in "
    "Python (initialize_model_parallel finds it with torch.where(groups == rank), its "
    "layers take weight_list[rank::world_size]), and a simulation runs every rank at once, "
    "where the rank is one value per rank. Use ranks in processes: tplab.launch(world_size)")


_STATES = ParallelStates(mp.initialize)  # one per tp size (tplab/frameworks/shards.py)


def _bring_up(tp: int) -> None:
    mp.initialize.destroy_model_parallel()
    with contextlib.redirect_stdout(io.StringIO()):  # "> initializing model parallel"
        mp.initialize.initialize_model_parallel(tp)


def init(tp: int | DeviceMesh) -> None:
    """fairscale's `initialize_model_parallel(tp)` on this process's ranks (torch's default
    group first made with 1 rank when there is none: the notebook); kept when it already
    has that size. fairscale puts model-parallel ranks innermost, as `tplab.make_mesh(dp=,
    tp=)` does, and this is checked against the mesh."""
    _STATES.init("fairscale.init", tp, _bring_up,
                 lambda: mp.initialize.get_model_parallel_group())


def reference(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`build_model` for grad_check/train_check: the fairscale model at tp = 1 (in the
    notebook a 1-rank group is made for it)."""
    return BuiltAt(init, build, "fairscale.reference")


def from_shards(build: Callable[[], nn.Module], dims: dict[str, int | None] | None = None,
                layers: dict | None = None) -> FromShards:
    """The plan: `build()` at the mesh's tp size, each parameter loaded with this rank's
    piece of the reference's weight, cut where LAYERS (and `layers`, your own layer types)
    says."""
    return FromShards(BuiltAt(init, build, "fairscale.from_shards"), dims,
                      {**LAYERS, **(layers or {})}, refuses_simulation=SIMULATION)
