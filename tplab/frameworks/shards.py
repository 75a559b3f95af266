"""A framework's parallel model built from a one-device reference's weights, by the shard
metadata the framework declares (both sides: the plan runs on the ranks).

    plan = tplab.frameworks.from_shards(build_parallel)   # build_parallel(mesh) -> model
    report = tplab.grad_check(lab, build_reference, plan, make_input)

Where each parameter's piece on a rank comes from is read, in this order, from:
1. a DTensor's own placements (torchtitan, `parallelize_module`): `distribute_tensor`
   cuts the piece, as DTensor defines it;
2. `dims={"name": dim or None}`, given by hand;
3. `layers={ModuleClass: {"weight": dim or None}}`: a table of a framework's layer types,
   for frameworks that mark nothing on their parameters (tplab.frameworks.fairscale's);
4. the attributes a parameter carries when the framework declares it sharded,
   `tensor_model_parallel` and `partition_dim` (Megatron-LM's convention, set by
   `megatron.core.tensor_parallel.layers.set_tensor_model_parallel_attributes`);
5. the shapes: the one dim in which the parallel parameter is shorter than the reference's
   (tp pieces in rank order, as `torch.chunk` splits), or none (a replica).

A framework that pads a sharded dim up to a multiple of tp (a vocabulary) gets zeros in
the padding. Each plain parameter's placement is then declared on its module
(`tp_placements`, what `tplab.layouts.tp_layout` reads), so grad_check assembles its
gradient by the same rule. The pieces are cut with `index_select` on the rank's index
(not `narrow`), so the plan also runs under `tplab.simulate`, where the rank is a tensor
of every rank's value.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

from tplab.errors import PlanError

__all__ = ["BuiltAt", "FromShards", "ParallelStates", "from_shards", "load_shards",
           "one_rank_group", "rank_piece", "shard_dim", "tp_coordinate"]

Dims = dict[str, "int | None"]


def one_rank_group() -> None:
    """A 1-rank process group in this process when it has none of its own: what a
    framework's tp = 1 build needs to create its groups (the notebook's one-device
    reference). torch's "fake" backend, in memory (nothing listens on a port; at 1 rank
    every collective is the identity), so that a `tplab.simulate` later in the same
    notebook can swap it for its own, as it swaps its own between world sizes. A real
    group (the ranks', or your own) is kept; so is a simulation's, replaced here by the
    1-rank one (the simulation makes its own again when it next runs)."""
    if dist.is_initialized():
        if (dist.get_backend() != "fake" or dist.get_world_size() == 1
                or enabled_local_tensor_mode()):  # inside a simulation's run: its group
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)


class ParallelStates:
    """A framework's parallel state for each tp size, built once and swapped in after that.

    Megatron-core and fairscale keep their process groups in their module's globals
    (`_TENSOR_MODEL_PARALLEL_GROUP`, ...) and a check needs two sizes in turn on every rank
    (the reference's tp = 1, then the plan's). Building them again each time makes new
    process groups every time, never freed: about 150 file descriptors per check and rank
    at world 2 with gloo, so a notebook would run out after a few checks. So each size's
    globals are kept, as the framework set them, and put back. A new default group (a
    simulation's swap) starts afresh."""

    NAME = re.compile(r"_[A-Z][A-Z0-9_]*")

    def __init__(self, module):
        self.module = module
        self.world = None
        self.current: int | None = None
        self.kept: dict[int, dict] = {}

    def init(self, who: str, tp: int | DeviceMesh, bring_up: Callable[[int], None],
             tp_group: Callable[[], dist.ProcessGroup]) -> None:
        """An adapter's `init`: the framework's state at tensor-parallel size `tp` (an int,
        or a mesh whose "tp" dim gives it) on this process's ranks, torch's default group
        first made with 1 rank when there is none (the notebook's reference). On a mesh,
        the framework's tp group (`tp_group()`) is checked to be the mesh's tp dim: said,
        not assumed. `who` names the adapter in errors."""
        mesh = tp if isinstance(tp, DeviceMesh) else None
        if mesh is not None:
            _, tp = tp_coordinate(mesh)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"{who}: tp must be an int >= 1 or a DeviceMesh, got {tp!r}")
        if mesh is None:  # the reference's build, in the notebook: a 1-rank group
            one_rank_group()
        if dist.get_world_size() % tp:
            raise ValueError(f"{who}: tp={tp} does not divide the world size "
                             f"{dist.get_world_size()}")
        self.use(tp, bring_up)
        if mesh is None:
            return
        names = mesh.mesh_dim_names or ()
        ours = sorted(dist.get_process_group_ranks(mesh.get_group("tp" if "tp" in names else 0)))
        theirs = sorted(dist.get_process_group_ranks(tp_group()))
        if ours != theirs:
            raise RuntimeError(f"{who}: the framework's tensor-parallel group is ranks "
                               f"{theirs}, the mesh's tp dim is {ours}: make the mesh "
                               "tp-innermost (tplab.make_mesh(dp=, tp=))")

    def use(self, tp: int, bring_up: Callable[[int], None]) -> None:
        """The framework's state at `tp`: kept, or brought up by `bring_up(tp)`."""
        if self.world is not dist.group.WORLD:
            self.world, self.current, self.kept = dist.group.WORLD, None, {}
        if self.current == tp:
            return
        if self.current is not None:
            self.kept[self.current] = {k: v for k, v in vars(self.module).items()
                                       if self.NAME.fullmatch(k)}
        if tp in self.kept:
            for k, v in self.kept[tp].items():
                setattr(self.module, k, v)
        else:
            bring_up(tp)
        self.current = tp


def tp_coordinate(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index on the mesh's "tp" dim, its size); a 1-D mesh is all tp."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names and mesh.ndim != 1:
        raise PlanError(f"from_shards: the mesh has dims {names}, none named 'tp'")
    dim = "tp" if "tp" in names else None
    return mesh.get_local_rank(dim), int(mesh.size(names.index("tp") if dim else 0))


def shard_dim(param: torch.Tensor, ref_shape: tuple, name: str = "") -> int | None:
    """The dim the framework declares `param` sharded on (`partition_dim` where
    `tensor_model_parallel` is set), else the one dim where it is shorter than
    `ref_shape`, else None (a replica). A PlanError names the parameter when neither
    reading is possible."""
    if getattr(param, "tensor_model_parallel", False):
        if getattr(param, "partition_stride", 1) != 1:
            raise PlanError(f"from_shards: {name} has partition_stride="
                            f"{param.partition_stride} (interleaved pieces); give its layout "
                            "with dims={...} and a reference laid out the same way")
        return int(param.partition_dim)
    if len(param.shape) != len(ref_shape):
        raise PlanError(f"from_shards: {name} is {tuple(param.shape)} on the ranks and "
                        f"{tuple(ref_shape)} in the reference: not a piece of it")
    shorter = [d for d, (a, b) in enumerate(zip(param.shape, ref_shape, strict=True)) if a < b]
    if len(shorter) > 1:
        raise PlanError(f"from_shards: {name} is {tuple(param.shape)} on the ranks and "
                        f"{tuple(ref_shape)} in the reference, shorter in dims {shorter}; "
                        f"say which with dims={{{name!r}: dim}}")
    return shorter[0] if shorter else None


def rank_piece(whole: torch.Tensor, dim: int | None, local_shape: tuple, rank, tp: int,
               name: str) -> torch.Tensor:
    """Rank `rank`'s piece of `whole` along `dim` (the rank-th of tp pieces of the local
    length), zero-padded where the framework pads the dim up to tp pieces."""
    if dim is None:
        piece = whole
    else:
        n = local_shape[dim]
        short = n * tp - whole.shape[dim]
        if short < 0 or short >= n:
            raise PlanError(f"from_shards: {name}: {tp} pieces of {n} on dim {dim} do not "
                            f"cover the reference's {whole.shape[dim]}")
        if short:
            pad = list(whole.shape)
            pad[dim] = short
            whole = torch.cat([whole, whole.new_zeros(pad)], dim)
        piece = whole.index_select(dim, torch.arange(n) + rank * n)
    if tuple(piece.shape) != tuple(local_shape):
        raise PlanError(f"from_shards: {name}: the rank holds {tuple(local_shape)}, the "
                        f"reference's piece on dim {dim} is {tuple(piece.shape)}")
    return piece


def _declared_dim(module: nn.Module, pname: str, p, whole, name: str, dims: Dims,
                  layers: dict) -> int | None:
    """Where `module.pname`'s piece comes from (the module docstring's order, 2-5)."""
    if name in dims:
        return dims[name]
    for cls, table in layers.items():
        if isinstance(module, cls) and pname in table:
            return table[pname]
    return shard_dim(p, tuple(whole.shape), name)


@torch.no_grad()
def load_shards(model: nn.Module, state: dict, mesh: DeviceMesh, dims: Dims | None = None,
                layers: dict | None = None) -> None:
    """Copy each rank's piece of `state` (the reference's, by name) into `model`, and
    declare each plain parameter's placement on its module (`tp_placements`)."""
    dims, layers = dims or {}, layers or {}
    rank, tp = tp_coordinate(mesh)
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
            dim = _declared_dim(module, pname, p, whole, name, dims, layers)
            p.copy_(rank_piece(whole, dim, tuple(p.shape), rank, tp, name))
            declared.setdefault(pname, Replicate() if dim is None else Shard(dim))
        if declared:
            module.tp_placements = declared


class FromShards:
    """A plan `(reference_model, mesh) -> parallel model`: `build_parallel(mesh)` builds the
    framework's model, then every parameter gets this rank's piece of the reference's
    weight of the same name (the module docstring says where its layout is read).

    `refuses_simulation`: None, or why the framework cannot run under `tplab.simulate`
    (grad_check and train_check raise it in the notebook before anything runs)."""

    refuses_simulation: str | None = None

    def __init__(self, build_parallel: Callable[[DeviceMesh], nn.Module],
                 dims: Dims | None = None, layers: dict | None = None,
                 refuses_simulation: str | None = None):
        if not callable(build_parallel):
            raise PlanError(f"from_shards: build_parallel must be a function (mesh) -> "
                            f"model, got {type(build_parallel).__name__}")
        if dims is not None and not (isinstance(dims, dict) and all(
                d is None or isinstance(d, int) for d in dims.values())):
            raise PlanError(f"from_shards: dims must be {{parameter name: dim or None}}, got "
                            f"{dims!r}")
        if layers is not None and not (isinstance(layers, dict) and all(
                isinstance(c, type) and isinstance(t, dict) for c, t in layers.items())):
            raise PlanError(f"from_shards: layers must be {{module class: {{parameter: dim "
                            f"or None}}}}, got {layers!r}")
        self.build_parallel = build_parallel
        self.dims = dict(dims or {})
        self.layers = dict(layers or {})
        self.refuses_simulation = refuses_simulation

    def __call__(self, reference: nn.Module, mesh: DeviceMesh) -> nn.Module:
        model = self.build_parallel(mesh)
        if not isinstance(model, nn.Module):
            raise PlanError(f"from_shards: build_parallel returned "
                            f"{type(model).__name__}, not a torch.nn.Module")
        load_shards(model, reference.state_dict(), mesh, self.dims, self.layers)
        return model

    def check_plan(self, model: nn.Module, tp: int) -> None:
        """Called by grad_check in the notebook before anything reaches the ranks."""
        unknown = set(self.dims) - {n for n, _ in model.named_parameters()}
        if unknown:
            raise PlanError(f"from_shards: dims names {sorted(unknown)}, which the reference "
                            "model has no parameter of")


def from_shards(build_parallel: Callable[[DeviceMesh], nn.Module], dims: Dims | None = None,
                layers: dict | None = None) -> FromShards:
    """The plan that builds `build_parallel(mesh)` and loads the reference's weights into it
    by the framework's shard metadata (module docstring). `dims={"name": dim or None}`
    states a parameter's layout where nothing declares it; `layers={ModuleClass:
    {"weight": dim}}` states it for every layer of a type."""
    return FromShards(build_parallel, dims, layers)


class BuiltAt:
    """A framework model's build at a tp size: `init(tp)` brings up the framework's
    parallel state, then `build()` (the user's, unchanged) constructs the model, which
    reads the tp size from that state. Called with no argument: tp = 1 (the one-device
    reference; in the notebook a 1-rank group is made for it). Called with a mesh: its
    "tp" dim's size (the plan's build). Travels to the ranks by pickle."""

    def __init__(self, init: Callable, build: Callable[[], nn.Module], who: str):
        if not callable(build):
            raise TypeError(f"{who}: build must be a function () -> model, got "
                            f"{type(build).__name__} {build!r}")
        self.init, self.build = init, build

    def __call__(self, mesh: DeviceMesh | None = None) -> nn.Module:
        self.init(1 if mesh is None else mesh)
        return self.build()
