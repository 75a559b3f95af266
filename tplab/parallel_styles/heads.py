"""tplab's styles for projections split by whole units (attention heads) on a 2-D view of
the tp mesh: transformers' `unit_colwise` and `unit_rowwise` (transformers 5.25,
distributed/tensor_parallel.py: `UnitColwiseParallel`, `UnitRowwiseParallel`; the view:
distributed/utils.py, `TransformersDeviceMesh.get_unit_mesh`).

A projection of `units` heads of `head_dim` features cannot be cut at any column: a head
split in two is no head. `unit_mesh(mesh, units)` views the tp ranks as a (groups, replicas)
grid, groups = gcd(units, tp): the weight is sharded over the groups (`Shard`) and
replicated over the replicas (`Replicate`), so every rank holds whole heads. With fewer
key/value heads than ranks (2 heads on 4 ranks: groups 2, replicas 2) ranks 0 and 1 hold
head 0, ranks 2 and 3 head 1; when tp divides the heads there is one replica and the style
is ColwiseParallel (RowwiseParallel) on a (tp, 1) grid.

- `UnitColwise(head_dim)`: input replicated (f over the groups: DTensor's), output this
  rank's heads; with replicas, each replica's key/value head only saw the query heads of
  its own rank, so the output's gradient is summed over the replicas (f).
- `UnitRowwise(head_dim)`: input this rank's heads, output summed over the groups (g);
  with replicas, the input's gradient is scaled by 1/replicas (the replicas recompute the
  same heads: `UnitColwise`'s sum would count them `replicas` times).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tplab.parallel_styles.explained import copy_with_cause
from tplab.parallel_styles.weights import TplabStyle
from tplab.style_specs import Collective, StyleSpec

_UNIT_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unit_mesh(mesh: DeviceMesh, units: int) -> DeviceMesh:
    """The 2-D (groups, replicas) view of the 1-D tp `mesh` for a weight of `units` heads,
    groups = gcd(units, tp), dims named ("tp", "unit_replicate") as transformers names them.
    One per mesh and number of groups (its process groups are made once, on every rank)."""
    if mesh.ndim != 1:
        raise ValueError(f"unit_mesh views a 1-D tp mesh, got a {mesh.ndim}-D one")
    if not isinstance(units, int) or units < 1:
        raise ValueError(f"units (heads in the weight) must be a positive int, got {units!r}")
    groups = math.gcd(units, mesh.size())
    held = _UNIT_MESHES.setdefault(mesh, {})
    if groups not in held:
        held[groups] = DeviceMesh(mesh.device_type,
                                  mesh.mesh.reshape(groups, mesh.size() // groups),
                                  mesh_dim_names=("tp", "unit_replicate"))
    return held[groups]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _units(features: int, head_dim: int, what: str, module: nn.Module) -> int:
    if features % head_dim:
        raise ValueError(f"{type(module).__name__}: {what} = {features} is not whole heads "
                         f"of head_dim = {head_dim}")
    return features // head_dim


class _UnitStyle(TplabStyle):
    def __init__(self, head_dim: int):
        super().__init__()
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        self.head_dim = head_dim

    def _distribute(self, module: nn.Module, mesh: DeviceMesh, placements: dict) -> None:
        for name, placement in placements.items():
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(
                distribute_tensor(p.detach(), mesh, placement,
                                  src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad)


class UnitColwise(_UnitStyle):
    """Column-parallel by whole heads of `head_dim` (a key or value projection with fewer
    heads than ranks): weight [Shard(0), Replicate()] on `unit_mesh`, replicated input,
    this rank's heads out (a plain tensor). transformers' `unit_colwise`."""

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """f on the input (DTensor's, over the groups); with replicas, f on the output."""
        return StyleSpec(
            # whole heads by construction (a head on several ranks, never split): no heads
            # check; the layouts live on a 2-D view of the mesh, not the plan check's
            modules=(nn.Linear,), layouts_known=False,
            backward=(Collective("all_reduce", "unit_colwise f: the replicated input's "
                                 "gradient is the sum of the groups' heads' terms; with "
                                 "fewer heads than ranks, a head's replicas each saw only "
                                 "their own rank's query heads: summed over the replicas"),))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"UnitColwise splits an nn.Linear, got {type(module).__name__}")
        mesh = unit_mesh(device_mesh, _units(module.out_features, self.head_dim,
                                             "out_features", module))
        self._distribute(module, mesh, {n: [Shard(0), Replicate()]
                                        for n, _ in module.named_parameters(recurse=False)})
        replicas, cause = mesh.size(1), self.spec(module).backward[0].why

        def pre(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
            return (DTensor.from_local(x, mesh, [Replicate(), Replicate()], run_check=False),
                    *args[1:])

        def post(mod, args, output):
            local = output.to_local() if isinstance(output, DTensor) else output
            if replicas > 1:
                local = copy_with_cause(local, mesh.get_group(1), cause)
            return local

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


class UnitRowwise(_UnitStyle):
    """Row-parallel by whole heads of `head_dim` (an attention output projection): weight
    [Shard(1), Replicate()] on `unit_mesh` (a bias replicated), this rank's heads in, the
    output summed over the groups (g), a plain tensor. transformers' `unit_rowwise`."""

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """g on the output (DTensor's Partial over the groups)."""
        return StyleSpec(
            modules=(nn.Linear,), layouts_known=False,  # a 2-D view of the mesh
            forward=(Collective("all_reduce", "unit_rowwise g: each group's heads give a "
                                "partial sum of the output: summed over the groups"),))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"UnitRowwise splits an nn.Linear, got {type(module).__name__}")
        mesh = unit_mesh(device_mesh, _units(module.in_features, self.head_dim,
                                             "in_features", module))
        self._distribute(module, mesh, {
            n: [Replicate(), Replicate()] if n == "bias" else [Shard(1), Replicate()]
            for n, _ in module.named_parameters(recurse=False)})
        replicas = mesh.size(1)

        def pre(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.to_local()
            if replicas > 1:
                x = _ScaleGrad.apply(x, 1 / replicas)
            return (DTensor.from_local(x, mesh, [Shard(x.ndim - 1), Replicate()],
                                       run_check=False), *args[1:])

        def post(mod, args, output):
            if isinstance(output, DTensor):  # Partial over the groups: g
                output = output.redistribute(placements=[Replicate(), Replicate()]).to_local()
            return output

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module
