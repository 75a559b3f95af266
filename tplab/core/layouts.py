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

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tplab.core import placements
from tplab.core.fsdp_layout import managed, over_piece, tp_view

__all__ = ["global_index", "tp_layout"]


def tp_layout(model: torch.nn.Module, of: str = "grad") -> dict[str, dict]:
    """{parameter name: {"value", "placement", "shape", "global_shape",
    "requires_grad"}} for every parameter of `model` (tied ones once, under their first
    name, as `named_parameters()` lists them).

    "value" is the local gradient (`of="grad"`) or the local parameter (`of="param"`),
    "placement" its layout on the tp dim as a string ("Shard(0)", "Replicate()",
    "Partial(sum)", "_StridedShard(dim=1, split_factor=2)") or None when nothing says. A
    DTensor on a mesh of more than one dim (FSDP2 over dp x tp) is kept whole, with placement
    "mesh" (the notebook places it). A DTensor on the tp dim also gets "index": the flat
    global index of each local element (`global_index`), or "unreadable": why not.
    "fsdp" is True for a parameter FSDP2 manages (its gradient is FSDP's, averaged over dp).
    One that FSDP2 sharded over dp alone, on top of a hand-written TP layer, is described
    by its TP piece (all-gathered over dp: `tplab.fsdp.tp_view`), as plain TP is.
    """
    out: dict[str, dict] = {}
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
                out[f"{path}.{name}" if path else name] = {
                    "value": tp_view(value), "placement": _named(placement, p.ndim),
                    "shape": tuple(p.shape), "global_shape": None,
                    "requires_grad": p.requires_grad, "index": None, "unreadable": None,
                    "fsdp": True, "dp_placement": placements.name(p.placements[0]),
                    "mesh_placements": _mesh_placements(p)}
                continue
            if isinstance(p, DTensor):
                global_shape = tuple(p.shape)
                placement = p.placements[-1]
            index = unreadable = None
            if isinstance(value, DTensor):
                if value.device_mesh.ndim > 1:
                    placement = placements.MESH
                else:
                    index, unreadable = global_index(value)
                    placement, value = value.placements[-1], value.to_local()
            elif isinstance(p, DTensor) and p.device_mesh.ndim == 1:
                index, unreadable = global_index(p)
            local = p.to_local() if isinstance(p, DTensor) else p
            out[f"{path}.{name}" if path else name] = {
                "value": value, "placement": _named(placement, local.ndim),
                "shape": tuple(local.shape), "global_shape": global_shape,
                "requires_grad": p.requires_grad, "index": index, "unreadable": unreadable,
                "fsdp": id(p) in fsdp, "mesh_placements": _mesh_placements(p)}
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
