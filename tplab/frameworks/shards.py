"""A framework's parallel model built from a one-device reference's weights, by the shard
metadata the framework declares (both sides: the plan runs on the ranks).

    plan = tplab.frameworks.from_shards(build_parallel)   # build_parallel(mesh) -> model
    report = tplab.grad_check(lab, build_reference, plan, make_input)

Where each parameter's rank piece comes from is read, in this order, from:
1. a DTensor's own placements (torchtitan, `parallelize_module`): `distribute_tensor`
   cuts the piece, as DTensor defines it;
2. the attributes Megatron-LM sets on a parameter it shards, `tensor_model_parallel` and
   `partition_dim` (`megatron.core.tensor_parallel.layers.set_tensor_model_parallel_
   attributes`; tplab.frameworks.fairscale sets the same on fairscale's layers, which mark
   nothing);
3. `dims={"name": dim or None}` given by hand;
4. the shapes: the one dim in which the parallel parameter is shorter than the reference's
   (tp pieces in rank order, as `torch.chunk` splits), or none (a replica).

Each plain parameter's placement is then declared on its module (`tp_placements`, what
`tplab.layouts.tp_layout` reads), so grad_check assembles its gradient by the same rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tplab.errors import PlanError

__all__ = ["FromShards", "from_shards", "one_rank_group", "shard_dim", "tp_coordinate"]


def one_rank_group() -> None:
    """A 1-rank gloo process group in this process when there is none yet: what a
    framework's tp = 1 build needs to create its groups (the notebook's one-device
    reference). In-memory (a HashStore): nothing listens on a port."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def tp_coordinate(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index on the mesh's "tp" dim, its size); a 1-D mesh is all tp."""
    names = mesh.mesh_dim_names or ()
    dim = "tp" if "tp" in names else None
    if dim is None and mesh.ndim != 1:
        raise PlanError(f"from_shards: the mesh has dims {names}, none named 'tp'")
    return int(mesh.get_local_rank(dim)), int(mesh.size(names.index("tp") if dim else 0))


def shard_dim(param: torch.Tensor, ref_shape: tuple, name: str = "") -> int | None:
    """The dim the framework declares `param` sharded on (Megatron's `partition_dim`), else
    the one dim where it is shorter than `ref_shape`, else None (a replica). A PlanError
    names the parameter when neither reading is possible."""
    if getattr(param, "tensor_model_parallel", False):
        if getattr(param, "partition_stride", 1) != 1:
            raise PlanError(f"from_shards: {name} has partition_stride="
                            f"{param.partition_stride} (interleaved pieces); give its layout "
                            "with dims={...} and a reference laid out the same way")
        return int(param.partition_dim)
    if len(param.shape) != len(ref_shape):
        raise PlanError(f"from_shards: {name} is {tuple(param.shape)} on the ranks and "
                        f"{tuple(ref_shape)} in the reference: not a shard of it")
    shorter = [d for d, (a, b) in enumerate(zip(param.shape, ref_shape, strict=True)) if a < b]
    if len(shorter) > 1:
        raise PlanError(f"from_shards: {name} is {tuple(param.shape)} on the ranks and "
                        f"{tuple(ref_shape)} in the reference, shorter in dims {shorter}; "
                        f"say which with dims={{{name!r}: dim}}")
    return shorter[0] if shorter else None


def _rank_piece(whole: torch.Tensor, dim: int | None, local_shape, rank: int, name: str):
    """Rank `rank`'s piece of `whole` along `dim`, zero-padded where the framework pads
    (a vocabulary rounded up to a multiple of tp)."""
    if dim is None:
        return whole
    n = local_shape[dim]
    piece = whole.narrow(dim, min(rank * n, whole.shape[dim]),
                         max(0, min(n, whole.shape[dim] - rank * n)))
    if piece.shape[dim] < n:
        pad = list(piece.shape)
        pad[dim] = n - piece.shape[dim]
        piece = torch.cat([piece, piece.new_zeros(pad)], dim)
    if tuple(piece.shape) != tuple(local_shape):
        raise PlanError(f"from_shards: {name}: the rank holds {tuple(local_shape)}, the "
                        f"reference's piece on dim {dim} is {tuple(piece.shape)}")
    return piece


class FromShards:
    """A plan `(reference_model, mesh) -> parallel model`: `build_parallel(mesh)` builds the
    framework's model, then every parameter gets this rank's piece of the reference's
    weight of the same name (see the module docstring for where its layout is read)."""

    def __init__(self, build_parallel: Callable[[DeviceMesh], nn.Module],
                 dims: dict[str, int | None] | None = None):
        if not callable(build_parallel):
            raise PlanError(f"from_shards: build_parallel must be a function (mesh) -> "
                            f"model, got {type(build_parallel).__name__}")
        if dims is not None and not (isinstance(dims, dict) and all(
                d is None or isinstance(d, int) for d in dims.values())):
            raise PlanError(f"from_shards: dims must be {{parameter name: dim or None}}, got "
                            f"{dims!r}")
        self.build_parallel = build_parallel
        self.dims = dict(dims or {})

    def __call__(self, reference: nn.Module, mesh: DeviceMesh) -> nn.Module:
        model = self.build_parallel(mesh)
        if not isinstance(model, nn.Module):
            raise PlanError(f"from_shards: build_parallel returned "
                            f"{type(model).__name__}, not a torch.nn.Module")
        load_shards(model, reference.state_dict(), mesh, self.dims)
        return model

    def check_plan(self, model: nn.Module, tp: int) -> None:
        """Called by grad_check in the notebook before anything reaches the ranks."""
        unknown = set(self.dims) - {n for n, _ in model.named_parameters()}
        if unknown:
            raise PlanError(f"from_shards: dims names {sorted(unknown)}, which the reference "
                            "model has no parameter of")


def from_shards(build_parallel: Callable[[DeviceMesh], nn.Module],
                dims: dict[str, int | None] | None = None) -> FromShards:
    """The plan that builds `build_parallel(mesh)` and loads the reference's weights into it
    by the framework's shard metadata (module docstring). `dims={"name": dim or None}`
    states a parameter's layout where nothing declares it."""
    return FromShards(build_parallel, dims)


@torch.no_grad()
def load_shards(model: nn.Module, state: dict, mesh: DeviceMesh,
                dims: dict[str, int | None] | None = None) -> None:
    """Copy each rank's piece of `state` (the reference's, by name) into `model`, and
    declare each plain parameter's placement on its module (`tp_placements`)."""
    dims = dims or {}
    rank, _ = tp_coordinate(mesh)
    for path, module in model.named_modules():
        declared = dict(getattr(module, "tp_placements", {}) or {})
        for pname, p in module.named_parameters(recurse=False):
            name = f"{path}.{pname}" if path else pname
            whole = state.get(name)
            if whole is None:
                continue  # not in the reference: grad_check reports it unpaired
            if isinstance(p, DTensor):
                p.copy_(distribute_tensor(whole.to(p.dtype), p.device_mesh, p.placements,
                                          src_data_rank=None))
                continue
            dim = dims[name] if name in dims else shard_dim(p, tuple(whole.shape), name)
            p.copy_(_rank_piece(whole, dim, tuple(p.shape), rank, name))
            declared.setdefault(pname, Replicate() if dim is None else Shard(dim))
        if declared:
            module.tp_placements = declared
