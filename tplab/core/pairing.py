"""Which parameter on the ranks is which parameter of the single-device model,
and putting the ranks' pieces back together: what `grad_check` needs to compare gradients of
any TP model. Both sides: `grad_check` pairs in the notebook, `train_check`'s ranks pair
their own (tplab/rank/train_step.py); the ranks read their parameters with
`tplab.layouts.tp_layout`.

- `pair(...)` pairs them with the reference's parameters: by `param_map` first, then by
  name, then by registration order and shape.
- `infer_layout` reads a layout from shapes, as Megatron-LM lays out its shards
  (`torch.chunk` in rank order): the reference's shape means a replica; one dimension
  divided by the tp size means Shard(that dim); one whose pieces add up to a little more
  than the reference's (a vocabulary padded to a multiple of tp) is Shard with padding.
- `gather(values, placement, tp)` puts the ranks' locals back together; `gather_indexed`
  does it for a DTensor from the global indices each rank holds (`layouts.global_index`), as
  DTensor itself places them (`_StridedShard`, uneven shards, any placement torch defines),
  never by guessing a concatenation.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

import torch

from tplab.core import placements
from tplab.errors import LabError
from tplab.layouts import ParamLayout


@dataclass(frozen=True)
class Pair:
    """A parameter on the ranks (`ranks`, its name there) paired with the reference's
    `ref`: its `placement` on the tp dim, `padded` (the length a padded Shard dim has on
    the ranks, else 0), `how` it was paired ("param_map", "name", "order and shape") and
    `whole_mesh`: a DTensor on the whole (dp, tp) mesh (`ParamLayout.whole_mesh`: FSDP2 x
    TP), placed whole from its own placements. It travels from the ranks to the notebook by
    pickle (tplab.train_check pairs there); a pair that learns more is a new one
    (`dataclasses.replace`)."""

    ranks: str
    ref: str
    placement: str | None
    padded: int
    how: str
    whole_mesh: bool = False


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


def _fits(info: ParamLayout, ref_shape: tuple, tp: int, placement: str | None = None):
    """(placement, padded) when the ranks' parameter fits the reference's shape, else None."""
    if info.whole_mesh:  # placed from its own placements: only its global shape must fit
        ok = info.global_shape is not None and tuple(info.global_shape) == tuple(ref_shape)
        return (info.placement, 0) if ok else None
    if info.global_shape is not None:  # a DTensor: its global shape says it
        if tuple(info.global_shape) != tuple(ref_shape):
            return None
        return info.placement, 0
    placement = placement or info.placement
    if placement is not None:
        if placements.is_partial(placement):
            return placement, 0
        if tuple(info.shape) == expected_shape(ref_shape, placement, tp):
            return placement, 0
        inferred = infer_layout(info.shape, ref_shape, tp)
        return inferred if inferred and inferred[0] == placement else None
    return infer_layout(info.shape, ref_shape, tp)


# what torch's wrappers put into parameter names: checkpoint_wrapper (activation
# checkpointing) and torch.compile's OptimizedModule
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped(name: str) -> str:
    """A parameter name without torch's wrapper prefixes (`WRAPPERS`)."""
    for prefix in WRAPPERS:
        name = name.replace(prefix, "")
    return name


def _placement_of(spec) -> str | None:
    if spec is None:
        return placements.REPLICATE
    if isinstance(spec, int):
        return placements.shard(spec)
    if isinstance(spec, str):
        return spec
    return placements.name(spec)


def pair(ref: dict[str, tuple], ranks: dict[str, ParamLayout], tp: int,
         param_map: dict | None = None, aliases: dict[str, str] | None = None):
    """Pair the ranks' parameters with the reference's.

    `ref`: {name: shape} in registration order; `ranks`: `tp_layout`'s ParamLayouts (rank
    0's); `aliases`: tied reference names -> the name they share a tensor with. Returns
    (pairs, unpaired on the ranks, unpaired in the reference, problems), pairs as `Pair`s;
    `problems` maps a parameter on the ranks to why a pairing asked for (param_map, or the
    same name) does not fit.
    """
    pairing = _Pairing(ref, ranks, tp, aliases or {})
    for rname, target in (param_map or {}).items():
        pairing.by_param_map(rname, target)
    for rname in list(pairing.free_ranks):  # the same name (a tied reference name counts)
        pairing.by_name(rname)
    # the rest by registration order and shape: each takes the first free one that fits,
    # exact fits first, so a padded fit (a vocabulary) never takes another's reference
    for exact in (True, False):
        for rname in [n for n in pairing.free_ranks if n not in pairing.problems]:
            pairing.by_order(rname, exact)
    paired = {p.ranks for p in pairing.pairs}
    unpaired_ranks = [n for n in ranks if n not in paired]
    return pairing.pairs, unpaired_ranks, list(pairing.free_ref), pairing.problems


class _Pairing:
    """`pair`'s state: the pairs made so far, what is still free on either side, and why
    a pairing asked for does not fit."""

    def __init__(self, ref: dict[str, tuple], ranks: dict[str, ParamLayout], tp: int,
                 aliases: dict[str, str]):
        self.ref, self.ranks, self.tp, self.aliases = ref, ranks, tp, aliases
        self.pairs: list[Pair] = []
        self.problems: dict[str, str] = {}
        self.free_ref, self.free_ranks = list(ref), list(ranks)

    def take(self, rname: str, refname: str, fit: tuple, how: str) -> None:
        self.pairs.append(Pair(rname, refname, fit[0], fit[1], how,
                               self.ranks[rname].whole_mesh))
        self.free_ranks.remove(rname)
        if refname in self.free_ref:
            self.free_ref.remove(refname)

    def by_param_map(self, rname: str, target) -> None:
        ranks, ref = self.ranks, self.ref
        if rname not in ranks:
            close = difflib.get_close_matches(rname, list(ranks), n=3, cutoff=0.4)
            raise LabError(f"param_map: the parallel model has no parameter {rname!r}; its "
                           f"parameters: {', '.join(map(repr, close or list(ranks)[:8]))}")
        refname, spec = (target, "infer") if isinstance(target, str) else (target[0], target[1])
        refname = self.aliases.get(refname, refname)
        if refname not in ref:
            close = difflib.get_close_matches(refname, list(ref), n=3, cutoff=0.4)
            raise LabError(f"param_map[{rname!r}]: the reference has no parameter "
                           f"{refname!r}; closest: {', '.join(map(repr, close or list(ref)[:8]))}")
        placement = None if spec == "infer" else _placement_of(spec)
        fit = _fits(ranks[rname], ref[refname], self.tp, placement)
        if fit is None:
            self.problems[rname] = (f"param_map pairs it with {refname} {tuple(ref[refname])}, "
                                    f"but its local shape {tuple(ranks[rname].shape)} is not "
                                    f"{placement or 'a layout'} of that over tp={self.tp}")
            self.free_ranks.remove(rname)
            return
        self.take(rname, refname, fit, "param_map")

    def by_name(self, rname: str) -> None:
        refname = self.aliases.get(unwrapped(rname), unwrapped(rname))
        if refname not in self.ref:
            return
        fit = _fits(self.ranks[rname], self.ref[refname], self.tp)
        if fit is not None:
            self.take(rname, refname, fit, "name")
        else:
            self.problems[rname] = (f"the reference's {refname} has shape "
                                    f"{tuple(self.ref[refname])}; local shape "
                                    f"{tuple(self.ranks[rname].shape)} fits no layout over "
                                    f"tp={self.tp}")

    def by_order(self, rname: str, exact: bool) -> None:
        for refname in self.free_ref:
            fit = _fits(self.ranks[rname], self.ref[refname], self.tp)
            if fit is not None and (fit[1] == 0) == exact:
                self.take(rname, refname, fit, "order and shape")
                return


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
