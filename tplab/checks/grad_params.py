"""Putting the ranks' pieces together, and grad_check's parameter rows: `assemble` places a
DTensor's LocalShards (reducing Partial ones by their op); `param_rows` pairs each
parameter on the ranks with the reference's (tplab.core.pairing), puts its pieces together
by how the ranks lay it out, and compares them."""

from __future__ import annotations

import dataclasses

import torch

from tplab.checks.grad_report import compare, unpaired, unreadable
from tplab.core import placements
from tplab.core.pairing import Pair, gather, gather_indexed, pair
from tplab.core.transfer import LocalShard
from tplab.errors import LabError
from tplab.layouts import ParamLayout

__all__ = ["ASSEMBLERS", "REDUCE", "assemble", "param_rows", "reduce_partial"]


def assemble(values: list) -> tuple[torch.Tensor | None, float | None]:
    """The whole tensor from the ranks' values, and the spread across its replicas.

    `values` holds one item per rank: a LocalShard (placed by its offsets; Partial shards
    reduced by their own op: "Partial(sum)" summed, "Partial(avg)" averaged, as a loss
    `out.mean()` under loss_parallel is) or a plain tensor (every rank should hold the same).
    The spread is the largest difference between copies that should be equal (None when
    nothing is replicated).
    """
    if any(v is None for v in values):
        return None, None
    if not isinstance(values[0], LocalShard):
        spread = max((float((v - values[0]).abs().max()) for v in values[1:]), default=None)
        return values[0], spread
    first = values[0]
    replicate = {i for i, p in enumerate(first.placements) if placements.is_replicate(p)}
    partial = [(i, placements.parse(p)[1]) for i, p in enumerate(first.placements)
               if placements.is_partial(p)]
    groups: dict[tuple, list[LocalShard]] = {}
    for s in values:
        key = tuple(c for i, c in enumerate(s.coordinate) if i not in replicate)
        groups.setdefault(key, []).append(s)
    full = torch.zeros(first.global_shape, dtype=first.local.dtype)
    terms: dict[tuple, dict[tuple, torch.Tensor]] = {}  # region -> {partial coords: term}
    spread = None
    for copies in groups.values():
        s = copies[0]
        region = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.local.shape, strict=True))
        if partial:
            key = tuple((r.start, r.stop) for r in region)
            terms.setdefault(key, {})[tuple(s.coordinate[i] for i, _ in partial)] = s.local
        else:
            full[region] = s.local
        for other in copies[1:]:
            spread = max(spread or 0.0, float((other.local - s.local).abs().max()))
    for key, by_coord in terms.items():
        full[tuple(slice(a, b) for a, b in key)] = reduce_partial(by_coord,
                                                                  [op for _, op in partial])
    return full, spread


# how a Partial placement's terms make the value, by its reduce op (torch's `Partial`)
REDUCE = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0),
          "max": lambda t: t.amax(0), "min": lambda t: t.amin(0),
          "product": lambda t: t.prod(0)}


def reduce_partial(terms: dict[tuple, torch.Tensor], ops: list[str]) -> torch.Tensor:
    """The value of Partial terms, {coordinates on the partial mesh dims: term}, reduced one
    mesh dim at a time by that dim's op (`REDUCE`)."""
    for op in ops:
        if op not in REDUCE:
            raise LabError(f"grad_check: a Partial({op}) tensor on the ranks: tplab reduces "
                           f"Partial of {', '.join(REDUCE)} only")
        merged: dict[tuple, list[torch.Tensor]] = {}
        for coord, t in terms.items():
            merged.setdefault(coord[1:], []).append(t)
        terms = {k: REDUCE[op](torch.stack(ts)) for k, ts in merged.items()}
    return terms[()]


def param_rows(model, results, tp, param_map, rows, atol, rtol, wholes=None,
               sizes: tuple = ()) -> list[str]:
    """Pair the ranks' parameters with the reference's; a row per pair (see tplab.core.pairing).
    `wholes` (a dict) gets each assembled gradient."""
    ref = dict(model.named_parameters())
    aliases = {n: ref_name for n, p in model.named_parameters(remove_duplicate=False)
               for ref_name, q in ref.items() if p is q and n != ref_name}
    buffers = [n for n, _ in model.named_buffers()]
    ranks = results[0].params
    pairs, lone_ranks, lone_ref, problems = pair({n: tuple(p.shape) for n, p in ref.items()},
                                                 ranks, tp, param_map, aliases)
    notes = []
    if buffers:
        notes.append(f"buffers are not compared (they get no gradient): {', '.join(buffers)}")
    by_ref: dict[str, list[Pair]] = {}
    for p in pairs:
        by_ref.setdefault(p.ref, []).append(p)
    frozen = []
    for name, p in ref.items():
        got = by_ref.get(name)
        if not got:
            continue
        if not p.requires_grad:
            frozen.append(name)
            continue
        new_rows, note = _grad_rows(name, p, got, results, tp, aliases, atol, rtol, wholes,
                                    sizes)
        rows.extend(new_rows)
        notes.extend([note] if note else [])
    if frozen:
        notes.append(f"need no gradient (requires_grad=False), not compared: "
                     f"{', '.join(frozen)}")
    rows.extend(_unpaired_rows(ref, ranks, lone_ranks, lone_ref, problems, notes))
    return notes


def _grad_rows(name, p, got: list[Pair], results, tp, aliases, atol, rtol, wholes, sizes=()):
    """(rows, note) for the reference parameter `name` (`p`) and the pairs on the ranks that
    hold it (more than one: tied in the reference, separate on the ranks). `wholes` (a dict,
    or None) gets the assembled gradient."""
    pieces = []
    for q in got:
        infos = [r.params[q.ranks] for r in results]
        why = next((i.unreadable for i in infos if i.unreadable), None)
        if why:  # never "wrong": tplab cannot read where each rank's elements lie
            return [unreadable(name, f"the layout on the ranks cannot be read ({why}); "
                                     "not checked")], None
        pieces.append(ASSEMBLERS[_placed_by(q, infos)](q, infos, p, tp))
    got = [q for q, _, _ in pieces]
    fulls = [full for _, full, _ in pieces]
    if p.grad is None and all(w is None for w in fulls):
        return [], f"{name}: no gradient on either side (not used by the loss)"
    full = None if any(w is None for w in fulls) else sum(fulls[1:], fulls[0])
    if wholes is not None:
        wholes[name] = full
    label, note = _pair_words(name, got, aliases, results[0].params)
    rows = [compare(name, "param_grad", full, p.grad, atol, rtol, note, label, sizes)]
    spread = max((s for _, _, s in pieces if s is not None), default=None)
    if spread is not None:
        rows.append(compare(name, "replica_spread", spread, p.grad, atol, rtol))
    return rows, None


def _placed_by(q: Pair, infos: list[ParamLayout]) -> str:
    """Which of ASSEMBLERS puts this pair's pieces together."""
    if q.whole_mesh:
        return "whole mesh"
    if infos[0].index is not None:
        return "indexed"
    return "by placement"


def _on_whole_mesh(q: Pair, infos, p, tp):
    """A DTensor on the whole (dp, tp) mesh (FSDP2): placed by its LocalShards' offsets."""
    return (q, *assemble([i.value for i in infos]))


def _by_global_index(q: Pair, infos, p, tp):
    """A DTensor on the tp dim: placed as DTensor places it (`layouts.global_index`)."""
    return (q, *gather_indexed([i.value for i in infos], [i.index for i in infos],
                               tuple(p.shape), placements.is_partial(q.placement), tp))


def _by_placement(q: Pair, infos, p, tp):
    """A plain tensor with a placement declared or read from its shape (tplab.core.pairing)."""
    values = [i.value for i in infos]
    dim = placements.shard_dim(q.placement) or 0
    if placements.is_shard(q.placement) and values[0] is not None:
        # every rank's piece as long as rank 0's: a padded tensor (a vocabulary padded to a
        # multiple of tp), cut back to the reference's length
        length = sum(v.shape[dim] for v in values[:tp])
        q = dataclasses.replace(q, padded=length if length > p.shape[dim] else 0)
    return (q, *gather(values, q.placement or placements.REPLICATE, tp, q.padded,
                       p.shape[dim] if p.ndim else 0))


# how a pair's pieces become the whole gradient: (pair, whole, spread) by _placed_by's answer
ASSEMBLERS = {"whole mesh": _on_whole_mesh, "indexed": _by_global_index,
              "by placement": _by_placement}


def _pair_words(name: str, got: list[Pair], aliases: dict,
                layouts: dict[str, ParamLayout]) -> tuple[str, str]:
    """(what the row says it was compared with on the ranks, its note). `layouts`: rank 0's
    `tp_layout`, for the placements of a DTensor on the whole mesh."""
    tied = [a for a, b in aliases.items() if b == name]
    held = {q.ranks: _held_as(q, layouts[q.ranks]) for q in got}
    label = "; ".join(held[q.ranks] if q.ranks == name else
                      f"{q.ranks} {held[q.ranks]} ({q.how})" for q in got)
    note = f"tied: also {', '.join(tied)}" if tied else ""
    if len(got) > 1:
        note = ("tied in the reference, separate on the ranks: their gradients are summed "
                "here, but an optimizer step would make the copies differ")
    if any(placements.is_partial(q.placement) and not q.whole_mesh for q in got):
        note = note or "Partial on the ranks (not yet reduced); summed here"
    if any(q.padded for q in got):
        note = note or f"padded to {got[0].padded} on the ranks; the padding is not compared"
    return label, note


def _held_as(q: Pair, info: ParamLayout) -> str:
    """How the ranks hold a pair's parameter: its placement on the tp dim, or for a DTensor
    on the whole mesh its placement on each mesh dim ("dp: Shard(0), tp: Shard(1)")."""
    if not q.whole_mesh:
        return q.placement
    return ", ".join(f"{dim}: {p}" for dim, p in info.mesh_placements.items())


def _unpaired_rows(ref, ranks, lone_ranks, lone_ref, problems, notes) -> list[dict]:
    """A row for each parameter that pairs with nothing (a note when it needs no
    gradient), saying how to pair it."""
    rows = []
    for name in lone_ranks:
        info = ranks[name]
        if not info.requires_grad:
            notes.append(f"{name} (only on the ranks) needs no gradient: not compared")
            continue
        why = problems.get(name) or (f"only on the ranks, local shape {info.shape}: no "
                                     "reference parameter left fits it by order and shape")
        hint = f"{lone_ref[0]!r}" if lone_ref else "'<reference name>'"
        rows.append(unpaired(name, f"{why}; pair it with param_map={{{name!r}: {hint}}}"))
    for name in lone_ref:
        if not ref[name].requires_grad:
            continue
        cands = ", ".join(lone_ranks) or "none"
        rows.append(unpaired(name, f"only in the reference, shape {tuple(ref[name].shape)}; "
                                   f"unpaired on the ranks: {cands}; pair with "
                                   f"param_map={{'<name on the ranks>': {name!r}}}"))
    return rows
