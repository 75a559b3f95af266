"""Where each rank's elements of a parallel model lie, read from the model itself (both
sides: a rank reads its own model; the notebook, a Simulation's and its own checks').

- `tp_layout(model)` is the one place that reads a parallel model's parameters: each one's
  local value (or gradient) and its placement on the tp dim, from a DTensor's own
  placements, from a hand-written layer's `tp_placements` (tplab.megatron's), or None when
  nothing says (a plain `nn.Parameter` slice written by hand).
- `global_index(dt)` asks DTensor where each local element of `dt` lives in the global
  tensor (`distribute_tensor` of an index tensor: no communication).

The notebook pairs and assembles what these return (tplab/core/pairing.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tplab.core import placements
from tplab.core.fsdp_layout import managed, over_piece, tp_view

__all__ = ["ParamLayout", "global_index", "tp_layout"]


@dataclass(frozen=True, eq=False)
class ParamLayout:
    """One parameter of a parallel model as a rank holds it (what `tp_layout` gives; it
    travels to the notebook by pickle, so both sides know the class).

    `value` is the local gradient or parameter; `placement` its layout on the tp dim as a
    string ("Shard(0)", "Replicate()", "Partial(sum)",
    "_StridedShard(dim=1, split_factor=2)"), or None when nothing says. `whole_mesh`: a
    DTensor on a mesh of more than one dim (FSDP2 over dp x tp): `value` is kept whole (the
    notebook places its LocalShards) and `placement` is its placement on the mesh dim named
    "tp" (None when the mesh has none). `shape` is the local shape, `global_shape` a
    DTensor's (else None). `index`: the flat global index of each local element of a
    DTensor on the tp dim (`global_index`), or `unreadable`: why not. `fsdp`: FSDP2 manages
    it (its gradient is FSDP's, averaged over dp). `dp_placement`: FSDP2 sharded it over dp
    alone, on top of a hand-written TP piece (then `value` is that TP piece, all-gathered
    over dp). `mesh_placements`: a DTensor's {mesh dim name: placement}."""

    value: torch.Tensor | None
    placement: str | None
    shape: tuple
    global_shape: tuple | None = None
    requires_grad: bool = True
    index: torch.Tensor | None = None
    unreadable: str | None = None
    fsdp: bool = False
    dp_placement: str | None = None
    mesh_placements: dict[str, str] | None = None
    whole_mesh: bool = False


def tp_layout(model: torch.nn.Module, of: str = "grad") -> dict[str, ParamLayout]:
    """{parameter name: ParamLayout} for every parameter of `model` (tied ones once, under
    their first name, as `named_parameters()` lists them). `value` is the local gradient
    (`of="grad"`) or the local parameter (`of="param"`). One that FSDP2 sharded over dp
    alone, on top of a hand-written TP layer, is described by its TP piece (all-gathered
    over dp: `tplab.fsdp.tp_view`), as plain TP is.
    """
    out: dict[str, ParamLayout] = {}
    seen: set[int] = set()
    fsdp = managed(model)
    for path, module in model.named_modules():
        declared = getattr(module, "tp_placements", {})
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            value = p.grad if of == "grad" else p.detach()
            placement = declared.get(name)
            global_shape = None
            if over_piece(p, name in declared):  # FSDP2 over a hand-written TP piece
                out[f"{path}.{name}" if path else name] = ParamLayout(
                    tp_view(value), _named(placement, p.ndim), tuple(p.shape),
                    requires_grad=p.requires_grad, fsdp=True,
                    dp_placement=placements.name(p.placements[0]),
                    mesh_placements=_mesh_placements(p))
                continue
            if isinstance(p, DTensor):
                global_shape = tuple(p.shape)
                placement = p.placements[-1]
            index = unreadable = None
            mesh_placements = _mesh_placements(p)
            whole_mesh = isinstance(value, DTensor) and value.device_mesh.ndim > 1
            if whole_mesh:  # placed whole in the notebook; its placement on the tp dim
                placement = (mesh_placements or {}).get("tp")
            elif isinstance(value, DTensor):
                index, unreadable = global_index(value)
                placement, value = value.placements[-1], value.to_local()
            elif isinstance(p, DTensor) and p.device_mesh.ndim == 1:
                index, unreadable = global_index(p)
            local = p.to_local() if isinstance(p, DTensor) else p
            out[f"{path}.{name}" if path else name] = ParamLayout(
                value, _named(placement, local.ndim), tuple(local.shape), global_shape,
                p.requires_grad, index, unreadable, id(p) in fsdp,
                mesh_placements=mesh_placements, whole_mesh=whole_mesh)
    return out


def _named(placement, ndim: int):
    """A placement as its string (a negative Shard dim made positive); None stays None."""
    if placement is None or isinstance(placement, str):
        return placement
    if placement.is_shard() and placement.dim < 0:
        placement = type(placement)(placement.dim + ndim)
    return placements.name(placement)


def _mesh_placements(p) -> dict[str, str] | None:
    """{mesh dim name: placement} of a DTensor, else None."""
    if not isinstance(p, DTensor):
        return None
    names = p.device_mesh.mesh_dim_names or tuple(map(str, range(p.device_mesh.ndim)))
    return {n: placements.name(q) for n, q in zip(names, p.placements, strict=True)}


def global_index(dt) -> tuple[torch.Tensor | None, str | None]:
    """(the flat global index of each element of `dt`'s local tensor, None), or
    (None, why) when torch cannot place it. DTensor itself places the indices
    (`distribute_tensor(arange, mesh, placements, src_data_rank=None)`: every rank cuts its
    own piece, no communication), so `_StridedShard` (transformers' packed weights: each rank
    holds its slice of every packed sub-matrix) and uneven shards come out as DTensor defines
    them. A Partial placement holds the whole index (its values are summed, not placed)."""
    placed = [Replicate() if p.is_partial() else p for p in dt.placements]
    try:
        whole = torch.arange(math.prod(dt.shape), device=dt.device_mesh.device_type)
        local = distribute_tensor(whole.reshape(dt.shape), dt.device_mesh, placed,
                                  src_data_rank=None).to_local()
    except Exception as e:  # a placement torch cannot place without its own runtime
        return None, f"{', '.join(map(repr, dt.placements))}: {type(e).__name__}: {e}"
    if tuple(local.shape) != tuple(dt.to_local().shape):
        return None, (f"{', '.join(map(repr, dt.placements))}: DTensor places a "
                      f"{tuple(local.shape)} piece here, the rank holds "
                      f"{tuple(dt.to_local().shape)}")
    return local.cpu(), None
