"""Which parameter on the ranks is which parameter of the single-device model, and how it
lies across the tp ranks: what `grad_check` needs to compare gradients of any TP model.

- `tp_layout(model)` (rank side) is the one place that reads a parallel model's parameters:
  each one's local value (or gradient) and its placement on the tp dim, from a DTensor's
  own placements, from a hand-written layer's `tp_placements` (tplab.megatron's), or None
  when nothing says (a plain `nn.Parameter` slice written by hand).
- `pair(...)` (notebook side) pairs them with the reference's parameters: by `param_map`
  first, then by name, then by registration order and shape.
- `infer_layout` reads a layout from shapes, as Megatron-LM lays out its shards
  (`torch.chunk` in rank order): the reference's shape means a replica; one dimension
  divided by the tp size means Shard(that dim); one whose pieces add up to a little more
  than the reference's (a vocabulary padded to a multiple of tp) is Shard with padding.
- `gather(values, placement, tp)` (notebook side) puts the ranks' locals back together;
  `gather_indexed` does it for a DTensor from the global indices each rank holds, as DTensor
  itself places them (`distribute_tensor` of an index tensor: `_StridedShard`, uneven shards,
  any placement torch defines), never by guessing a concatenation.
"""

from __future__ import annotations

import difflib
import math

import torch

from tplab import placements
from tplab.errors import LabError

# --- rank side ---------------------------------------------------------------------------

def tp_layout(model: torch.nn.Module, of: str = "grad") -> dict[str, dict]:
    """Rank side: {parameter name: {"value", "placement", "shape", "global_shape",
    "requires_grad"}} for every parameter of `model` (tied ones once, under their first
    name, as `named_parameters()` lists them).

    "value" is the local gradient (`of="grad"`) or the local parameter (`of="param"`),
    "placement" its layout on the tp dim as a string ("Shard(0)", "Replicate()",
    "Partial(sum)", "_StridedShard(dim=1, split_factor=2)") or None when nothing says. A
    DTensor on a mesh of more than one dim (FSDP2 over dp x tp) is kept whole, with placement
    "mesh" (the notebook places it). A DTensor on the tp dim also gets "index": the flat
    global index of each local element (`global_index`), or "unreadable": why not.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, dict] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        declared = getattr(module, "tp_placements", {})
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            value = p.grad if of == "grad" else p.detach()
            placement = declared.get(name)
            global_shape = None
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
            if placement is not None and not isinstance(placement, str):
                if placement.is_shard() and placement.dim < 0:
                    placement = type(placement)(placement.dim + local.ndim)
                placement = placements.name(placement)
            out[f"{path}.{name}" if path else name] = {
                "value": value, "placement": placement, "shape": tuple(local.shape),
                "global_shape": global_shape, "requires_grad": p.requires_grad,
                "index": index, "unreadable": unreadable}
    return out


def global_index(dt) -> tuple[torch.Tensor | None, str | None]:
    """Rank side: (the flat global index of each element of `dt`'s local tensor, None), or
    (None, why) when torch cannot place it. DTensor itself places the indices
    (`distribute_tensor(arange, mesh, placements, src_data_rank=None)`: every rank cuts its
    own piece, no communication), so `_StridedShard` (transformers' packed weights: each rank
    holds its slice of every packed sub-matrix) and uneven shards come out as DTensor defines
    them. A Partial placement holds the whole index (its values are summed, not placed)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

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


# --- notebook side -----------------------------------------------------------------------

def infer_layout(local: tuple, ref: tuple, tp: int) -> tuple[str, int] | None:
    """(placement, padded length) of a local shard of a tensor shaped `ref` over `tp` ranks,
    read from the shapes: ("Replicate()", 0) for the same shape, ("Shard(d)", 0) for dim d
    divided by tp, ("Shard(d)", n) for a dim padded to n = local[d] * tp > ref[d] (a
    vocabulary padded to a multiple of tp); None when no layout fits."""
    local, ref = tuple(local), tuple(ref)
    if len(local) != len(ref):
        return None
    if local == ref:
        return placements.REPLICATE, 0
    differ = [d for d in range(len(ref)) if local[d] != ref[d]]
    if len(differ) != 1 or tp < 2:
        return None
    d = differ[0]
    if local[d] * tp == ref[d]:
        return placements.shard(d), 0
    if ref[d] < local[d] * tp < ref[d] + tp * max(local[d] // 2, 1) and local[d] < ref[d]:
        return placements.shard(d), local[d] * tp
    return None


def expected_shape(ref: tuple, placement: str, tp: int) -> tuple:
    d = placements.shard_dim(placement)
    if d is None:
        return tuple(ref)
    shape = list(ref)
    shape[d] = -(-shape[d] // tp)  # torch.chunk: the first ranks get the larger pieces
    return tuple(shape)


def _fits(info: dict, ref_shape: tuple, tp: int, placement: str | None = None):
    """(placement, padded) when the ranks' parameter fits the reference's shape, else None."""
    if info.get("placement") == placements.MESH:
        ok = info["global_shape"] is not None and tuple(info["global_shape"]) == tuple(ref_shape)
        return (placements.MESH, 0) if ok else None
    if info.get("global_shape") is not None:  # a DTensor: its global shape says it
        if tuple(info["global_shape"]) != tuple(ref_shape):
            return None
        return info["placement"], 0
    placement = placement or info.get("placement")
    if placement is not None:
        if placements.is_partial(placement):
            return placement, 0
        if tuple(info["shape"]) == expected_shape(ref_shape, placement, tp):
            return placement, 0
        inferred = infer_layout(info["shape"], ref_shape, tp)
        return inferred if inferred and inferred[0] == placement else None
    return infer_layout(info["shape"], ref_shape, tp)


def _placement_of(spec) -> str | None:
    if spec is None:
        return placements.REPLICATE
    if isinstance(spec, int):
        return placements.shard(spec)
    if isinstance(spec, str):
        return spec
    return placements.name(spec)


def pair(ref: dict[str, tuple], ranks: dict[str, dict], tp: int, param_map: dict | None = None,
         aliases: dict[str, str] | None = None):
    """Pair the ranks' parameters with the reference's.

    `ref`: {name: shape} in registration order; `ranks`: `tp_layout`'s dicts (rank 0's);
    `aliases`: tied reference names -> the name they share a tensor with. Returns (pairs,
    unpaired on the ranks, unpaired in the reference, problems), pairs as dicts {ranks,
    ref, placement, padded, how}; `problems` maps a parameter on the ranks to why a pairing
    asked for (param_map, or the same name) does not fit.
    """
    aliases = aliases or {}
    pairs, problems = [], {}
    free_ref = list(ref)
    free_ranks = list(ranks)

    def take(rname, refname, fit, how):
        pairs.append({"ranks": rname, "ref": refname, "placement": fit[0], "padded": fit[1],
                      "how": how})
        free_ranks.remove(rname)
        if refname in free_ref:
            free_ref.remove(refname)

    for rname, target in (param_map or {}).items():
        if rname not in ranks:
            close = difflib.get_close_matches(rname, list(ranks), n=3, cutoff=0.4)
            raise LabError(f"param_map: the parallel model has no parameter {rname!r}; its "
                           f"parameters: {', '.join(map(repr, close or list(ranks)[:8]))}")
        refname, spec = (target, "infer") if isinstance(target, str) else (target[0], target[1])
        refname = aliases.get(refname, refname)
        if refname not in ref:
            close = difflib.get_close_matches(refname, list(ref), n=3, cutoff=0.4)
            raise LabError(f"param_map[{rname!r}]: the reference has no parameter "
                           f"{refname!r}; closest: {', '.join(map(repr, close or list(ref)[:8]))}")
        placement = None if spec == "infer" else _placement_of(spec)
        fit = _fits(ranks[rname], ref[refname], tp, placement)
        if fit is None:
            problems[rname] = (f"param_map pairs it with {refname} {tuple(ref[refname])}, but "
                               f"its local shape {tuple(ranks[rname]['shape'])} is not "
                               f"{placement or 'a layout'} of that over tp={tp}")
            free_ranks.remove(rname)
            continue
        take(rname, refname, fit, "param_map")

    for rname in list(free_ranks):  # the same name (a tied reference name counts)
        refname = aliases.get(rname, rname)
        if refname in ref:
            fit = _fits(ranks[rname], ref[refname], tp)
            if fit is not None:
                take(rname, refname, fit, "name")
            else:
                problems[rname] = (f"the reference's {refname} has shape "
                                   f"{tuple(ref[refname])}; local shape "
                                   f"{tuple(ranks[rname]['shape'])} fits no layout over "
                                   f"tp={tp}")

    # the rest by registration order and shape: each takes the first free one that fits,
    # exact fits first, so a padded fit (a vocabulary) never takes another's reference
    for exact in (True, False):
        for rname in [n for n in free_ranks if n not in problems]:
            for refname in free_ref:
                fit = _fits(ranks[rname], ref[refname], tp)
                if fit is not None and (fit[1] == 0) == exact:
                    take(rname, refname, fit, "order and shape")
                    break
    unpaired_ranks = [n for n in ranks if n not in {p["ranks"] for p in pairs}]
    return pairs, unpaired_ranks, list(free_ref), problems


def gather(values: list, placement: str, tp: int, padded: int = 0, ref_len: int = 0):
    """(whole tensor, spread) from every rank's local piece (rank r = dp replica r // tp,
    tp rank r % tp): Shard(d) concatenated on d in tp order, Partial summed, Replicate
    taken from tp rank 0; the spread is the largest difference between copies that should
    be equal (tp ranks of a replica, dp replicas of the whole), None when there are none.
    A padded Shard(d) is cut back to the reference's `ref_len` on d."""
    if any(v is None for v in values):
        return None, None
    spread = None
    wholes = []
    dim = placements.shard_dim(placement)
    for d in range(0, len(values), tp):
        parts = [v.detach() for v in values[d:d + tp]]
        if dim is not None:
            whole = torch.cat(parts, dim)
            if padded:
                whole = whole.narrow(dim, 0, ref_len)
        elif placements.is_partial(placement):
            whole = torch.stack(parts).sum(0)
        else:
            whole = parts[0]
            for other in parts[1:]:
                spread = max(spread or 0.0, float((other - whole).abs().max()))
        wholes.append(whole)
    for other in wholes[1:]:
        diff = float((other - wholes[0]).abs().max()) if other.shape == wholes[0].shape else \
            float("inf")
        spread = max(spread or 0.0, diff)
    return wholes[0], spread


def gather_indexed(values: list, indexes: list, global_shape: tuple, partial: bool,
                   tp: int):
    """(whole tensor, spread) of a DTensor from every rank's local piece and the global
    indices it holds (`global_index`; rank r = dp replica r // tp). Partial pieces are summed
    within a tp group; elements more than one rank holds (replicas) give the spread: the
    largest difference between copies that should be equal. None, None if a piece is
    missing."""
    if any(v is None for v in values) or any(i is None for i in indexes):
        return None, None
    numel = math.prod(global_shape)
    dtype = values[0].dtype
    wholes = []
    for d in range(0, len(values), tp):
        flat = torch.zeros(numel, dtype=dtype)
        seen = torch.zeros(numel, dtype=torch.bool)
        spread = None
        for v, i in zip(values[d:d + tp], indexes[d:d + tp], strict=True):
            v, i = v.detach().reshape(-1).to(dtype), i.reshape(-1)
            if partial:
                flat.index_add_(0, i, v)
                continue
            again = seen[i]
            if bool(again.any()):
                diff = float((flat[i[again]] - v[again]).abs().max())
                spread = max(spread or 0.0, diff)
            flat[i[~again]] = v[~again]
            seen[i] = True
        wholes.append((flat.reshape(global_shape), spread))
    full, spread = wholes[0]
    for other, s in wholes[1:]:
        spread = max(spread or 0.0, s or 0.0, float((other - full).abs().max()))
    return full, spread
