"""Megatron-core on the lab's ranks (both sides): its parallel state brought up on the lab's
mesh, its own tp = 1 build as the one-device reference, its parallel build loaded from the
reference's weights by the `partition_dim` it declares.

    from tplab.frameworks import megatron as mf
    reference = mf.reference(build)      # build() -> model: at tp = 1 (a 1-rank group here)
    plan = mf.from_shards(build)         # on the ranks: at tp = the mesh's, same weights
    report = tplab.grad_check(lab, reference, plan, make_input)

`build()` is the user's, unchanged: it constructs Megatron layers, which read the tp size
from `megatron.core.parallel_state` (set here before each build). Mirrors
`parallel_state.initialize_model_parallel` and `tensor_parallel.layers` of megatron-core
0.16.1 (docs/FRAMEWORKS.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplab.frameworks.shards import FromShards, one_rank_group, tp_coordinate

try:
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.model_parallel_config import ModelParallelConfig
except ImportError as e:
    raise ImportError("tplab.frameworks.megatron needs the package megatron-core "
                      "(pip install 'tplab[frameworks]'; tested with 0.16.1)") from e

__all__ = ["config", "from_shards", "init", "reference"]


def init(tp: int | DeviceMesh) -> None:
    """Megatron's parallel state with tensor-parallel size `tp` (an int, or a mesh whose
    "tp" dim gives it) on this process's ranks: `initialize_model_parallel`, torch's default
    group first made with 1 rank when there is none (the notebook). Megatron orders ranks
    tp-first, as `tplab.make_mesh(dp=, tp=)` does, so its tp groups are the mesh's."""
    if isinstance(tp, DeviceMesh):
        _, tp = tp_coordinate(tp)
    one_rank_group()
    if dist.get_world_size() % tp:
        raise ValueError(f"megatron.init: tp={tp} does not divide the world size "
                         f"{dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized() and \
            parallel_state.get_tensor_model_parallel_world_size() == tp:
        return
    parallel_state.destroy_model_parallel()
    # gloo groups are Megatron's extra CPU groups for its distributed optimizer; on CPU
    # the groups themselves are gloo already
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    # "set CUDA_DEVICE_MAX_CONNECTIONS=1" is advice for CUDA streams
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")


def config(**options) -> ModelParallelConfig:
    """Megatron's `ModelParallelConfig` for the current tp size, initialised on the CPU
    (`use_cpu_initialization=True`: the master weight is drawn whole, then split, so tp = 1
    and tp = N builds draw the same numbers). `options` go to ModelParallelConfig."""
    options.setdefault("use_cpu_initialization", True)
    options.setdefault("tensor_model_parallel_size",
                       parallel_state.get_tensor_model_parallel_world_size())
    return ModelParallelConfig(**options)


class _Reference:
    """`build()` at tp = 1 (see `reference`); travels to the ranks by pickle."""

    def __init__(self, build: Callable[[], nn.Module]):
        self.build = build

    def __call__(self) -> nn.Module:
        init(1)
        return self.build()


class _Parallel:
    """`build()` at the mesh's tp size (see `from_shards`)."""

    def __init__(self, build: Callable[[], nn.Module]):
        self.build = build

    def __call__(self, mesh: DeviceMesh) -> nn.Module:
        init(mesh)
        return self.build()


def reference(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`build_model` for grad_check/train_check: Megatron's own model at tp = 1, its
    parallel state first set to tp = 1 (in the notebook a 1-rank group is made for it)."""
    if not callable(build):
        raise TypeError(f"megatron.reference: build must be a function () -> model, got "
                        f"{type(build).__name__}")
    return _Reference(build)


def from_shards(build: Callable[[], nn.Module],
                dims: dict[str, int | None] | None = None) -> FromShards:
    """The plan: `build()` at the mesh's tp size, its parameters loaded with this rank's
    piece of the reference's weights by the `partition_dim` Megatron declares
    (tplab.frameworks.shards)."""
    if not callable(build):
        raise TypeError(f"megatron.from_shards: build must be a function () -> model, got "
                        f"{type(build).__name__}")
    return FromShards(_Parallel(build), dims)
