"""`sharding_map`: which rank holds which block of a DTensor, drawn from the ranks' shards.

The input is what `lab.run` returns for a DTensor (one `LocalShard` per rank), or for a
model's parameters (name -> list of per-rank shards). Every block of the global tensor is
drawn once: in its rank's colour when one rank holds it, hatched grey with a chip per rank
when several ranks hold a copy (Replicate), cross-hatched with a dashed edge when they
hold summands of it (Partial): the full value is their sum, as in DTensor's `Partial`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from tplab.core import placements
from tplab.core.output import format_rank_list
from tplab.core.transfer import LocalShard
from tplab.viz.palette import SHARED_COLOR, rank_color, style


def mesh_name(shard: LocalShard) -> str:
    """(2, 2), ("dp", "tp") -> "dp=2 × tp=2"."""
    names = shard.mesh_dim_names or tuple(f"dim{i}" for i in range(len(shard.mesh_shape)))
    return " × ".join(f"{n}={s}" for n, s in zip(names, shard.mesh_shape, strict=False))


def _chunk_offsets(shard: LocalShard) -> tuple[int, ...]:
    """Offsets of a shard that came without them, by torch.chunk's rule (what DTensor uses)."""
    offsets = [0] * len(shard.global_shape)
    sizes = list(shard.global_shape)
    for mesh_dim, text in enumerate(shard.placements):
        kind, dim = placements.parse(text)
        if kind != placements.SHARD_KIND:
            continue
        dim %= len(sizes)
        n = shard.mesh_shape[mesh_dim]
        chunk = math.ceil(sizes[dim] / n)
        start = min(shard.coordinate[mesh_dim] * chunk, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(chunk, sizes[dim] - start))
    return tuple(offsets)


@dataclass
class Block:
    """One block of a global tensor and the ranks that hold it."""

    rows: tuple[int, int]  # [start, stop) in the 2-D view (a 1-D tensor is one row)
    cols: tuple[int, int]
    ranks: list[int]
    kind: str  # "sole" (one rank), "replicated" (copies), "partial" (summands)
    local_shape: tuple[int, ...]


def _as_shards(name: str, items: Sequence) -> list[LocalShard]:
    """Per-rank items -> LocalShards; plain tensors of one shape count as replicated."""
    items = list(items)
    if all(isinstance(s, LocalShard) for s in items):
        return items
    if all(isinstance(t, torch.Tensor) for t in items):
        shapes = {tuple(t.shape) for t in items}
        if len(shapes) != 1:
            raise ValueError(
                f"{name}: plain tensors of different shapes on the ranks {sorted(shapes)}; "
                "without DTensor placements their layout is unknown (return DTensors)")
        shape = shapes.pop()
        return [LocalShard(t, (placements.REPLICATE,), shape, (len(items),), None, (r,), r,
                           offsets=(0,) * len(shape)) for r, t in enumerate(items)]
    raise TypeError(f"{name}: expected a list of LocalShard (one per rank), got "
                    f"{sorted({type(s).__name__ for s in items})}")


def blocks(shards: Sequence[LocalShard]) -> list[Block]:
    """Group a DTensor's per-rank shards into the distinct blocks of the global tensor."""
    shards = list(shards)
    shape = tuple(shards[0].global_shape)
    if len({tuple(s.global_shape) for s in shards}) != 1:
        raise ValueError("shards of different global shapes: not one DTensor")
    if len(shape) > 2:
        raise ValueError(f"sharding_map draws 1-D and 2-D tensors; got shape {shape}")
    found: dict[tuple, Block] = {}
    for s in sorted(shards, key=lambda s: s.rank):
        offsets = tuple(s.offsets) or _chunk_offsets(s)
        local = tuple(s.local.shape) if s.local is not None else ()
        if math.prod(local) == 0 and shape and math.prod(shape) != 0:
            continue  # an uneven shard can leave a rank nothing
        full = [(o, o + n) for o, n in zip(offsets, local, strict=False)]
        rows, cols = ((0, 1), (0, 1)) if not shape else (
            ((0, 1), full[0]) if len(shape) == 1 else (full[0], full[1]))
        key = (rows, cols)
        if key not in found:
            found[key] = Block(rows, cols, [], "sole", local)
        found[key].ranks.append(s.rank)
    partial = any(placements.parse(p)[0] == placements.PARTIAL_KIND
                  for s in shards for p in s.placements)
    for b in found.values():
        if len(b.ranks) > 1:
            b.kind = "partial" if partial else "replicated"
    return sorted(found.values(), key=lambda b: (b.rows, b.cols))


def _normalise(shards) -> dict[str, list[LocalShard]]:
    if isinstance(shards, LocalShard):
        shards = [shards]
    if isinstance(shards, Mapping):
        return {str(k): _as_shards(str(k), v) for k, v in shards.items()}
    shards = list(shards)
    if shards and all(isinstance(s, Mapping) for s in shards):  # per rank: {name: shard}
        return {k: _as_shards(k, [s[k] for s in shards]) for k in shards[0]}
    return {"tensor": _as_shards("tensor", shards)}


def _label(b: Block, one_d: bool) -> str:
    ranks = format_rank_list(b.ranks).replace("ranks ", "R").replace("rank ", "R")
    sep = " " if one_d else "<br>"
    if b.kind == "partial":
        return f"Σ {ranks}{sep}partial sums"
    if b.kind == "replicated":
        return f"{ranks}{sep}copies"
    return ranks


def _hover(name: str, b: Block, one_d: bool) -> str:
    where = (f"[{b.cols[0]}:{b.cols[1]}]" if one_d
             else f"[{b.rows[0]}:{b.rows[1]}, {b.cols[0]}:{b.cols[1]}]")
    what = {"sole": "held by", "replicated": "a full copy on each of",
            "partial": "a partial sum (add them up for the value) on each of"}[b.kind]
    return (f"<b>{name}{where}</b><br>{what} {format_rank_list(b.ranks)}"
            f"<br>local shape {tuple(b.local_shape)}")


def sharding_map(shards, *, name: str = "tensor", cols: int | None = None,
                 title: str | None = None) -> go.Figure:
    """Draw which rank holds which block of each 1-D or 2-D tensor.

    `shards`: a list of per-rank `LocalShard` (one DTensor, as `lab.run` returns it), a
    dict name -> such a list (a model's parameters), or a list per rank of dicts
    name -> shard. Each block is a trace whose `meta` holds tensor, ranks, kind, rows, cols.
    """
    tensors = _normalise(shards)
    if list(tensors) == ["tensor"]:
        tensors = {name: tensors["tensor"]}
    if not tensors:
        raise ValueError("nothing to draw: no tensors given")
    n = len(tensors)
    ncols = cols or min(n, 3)
    nrows = math.ceil(n / ncols)
    titles = []
    for tname, sh in tensors.items():
        places = ", ".join(placements.long(p) for p in sh[0].placements)
        titles.append(f"<b>{tname}</b> {tuple(sh[0].global_shape)}<br>[{places}]")
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=titles,
                        vertical_spacing=0.5 / max(nrows, 1) if nrows > 1 else 0.1,
                        horizontal_spacing=0.08)
    seen: set[str] = set()  # the shared kinds already in the legend
    for i, (tname, sh) in enumerate(tensors.items()):
        _draw_tensor(fig, tname, sh, i // ncols + 1, i % ncols + 1, seen)
    # The legend: one square per rank that holds anything, in rank order.
    for r in sorted({r for t in fig.data if isinstance(t.meta, dict) for r in t.meta["ranks"]}):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"rank {r}",
                                 legendgroup=f"rank {r}", legendrank=r,
                                 marker={"color": rank_color(r), "size": 13, "symbol": "square"}))
    first = next(iter(tensors.values()))[0]
    kinds = {b for t in fig.data if isinstance(t.meta, dict) for b in [t.meta["kind"]]}
    notes = ["colour = the rank that holds a block"]
    if "replicated" in kinds:
        notes.append("hatched / = every listed rank holds a copy")
    if "partial" in kinds:
        notes.append("hatched x, dashed = each rank holds a summand (Partial)")
    style(fig, title or f"Which rank holds which block (mesh {mesh_name(first)})",
          " · ".join(notes), height=max(360, 300 * nrows + 140), width=1100,
          margin={"t": 145, "l": 70, "r": 40, "b": 60}, legend={"title": {"text": "holder"}})
    fig.update_annotations(font_size=14)
    return fig


def _draw_tensor(fig, tname: str, sh: list[LocalShard], row: int, col: int,
                 seen: set[str]) -> None:
    """One tensor's panel: a filled box per block, its label, chips for shared blocks."""
    one_d = len(sh[0].global_shape) <= 1
    bl = blocks(sh)
    for b in bl:
        fig.add_trace(_block_trace(tname, b, one_d, seen), row=row, col=col)
    # Labels (with the hover text) at each block's centre; chips for shared blocks.
    cx = [(b.cols[0] + b.cols[1]) / 2 for b in bl]
    cy = [(b.rows[0] + b.rows[1]) / 2 for b in bl]
    fig.add_trace(go.Scatter(
        x=cx, y=cy, mode="text", text=[_label(b, one_d) for b in bl], textfont={"size": 13},
        hovertext=[_hover(tname, b, one_d) for b in bl], hoverinfo="text",
        showlegend=False, name=f"{tname} labels"), row=row, col=col)
    xmax = sh[0].global_shape[-1] if sh[0].global_shape else 1
    for b, x, y in zip(bl, cx, cy, strict=True):
        if b.kind == "sole":
            continue
        step = 0.065 * xmax  # a chip is about 5% of the panel wide, whatever the block
        ychip = 1.45 if one_d else y + (b.rows[1] - b.rows[0]) * 0.28
        for j, r in enumerate(b.ranks):
            fig.add_trace(go.Scatter(
                x=[x + (j - (len(b.ranks) - 1) / 2) * step], y=[ychip], mode="markers",
                name=f"rank {r}", marker={"color": rank_color(r), "size": 13,
                                          "symbol": "square",
                                          "line": {"color": "#424242", "width": 1}},
                legendgroup=f"rank {r}", showlegend=False, hoverinfo="name"),
                row=row, col=col)
    _panel_axes(fig, sh[0].global_shape, bl, one_d, xmax, row, col)


def _block_trace(tname: str, b: Block, one_d: bool, seen: set[str]) -> go.Scatter:
    """A block as a filled box: its rank's colour, or hatched grey for a shared one (the
    first of each shared kind in the legend)."""
    (r0, r1), (c0, c1) = b.rows, b.cols
    if b.kind == "sole":
        r = b.ranks[0]
        look = {"fillcolor": rank_color(r), "name": f"rank {r}",
                "legendgroup": f"rank {r}", "showlegend": False}
    else:
        shape = "x" if b.kind == "partial" else "/"
        look = {"fillcolor": SHARED_COLOR, "name": b.kind, "legendgroup": b.kind,
                "showlegend": b.kind not in seen, "legendrank": 1000,
                "fillpattern": {"shape": shape, "fgcolor": "#9e9e9e", "size": 10}}
        seen.add(b.kind)
    dash = "dash" if b.kind == "partial" else "solid"
    return go.Scatter(
        x=[c0, c1, c1, c0, c0], y=[r0, r0, r1, r1, r0], mode="lines", fill="toself",
        line={"color": "#424242" if b.kind == "partial" else "white", "width": 2,
              "dash": dash},
        hoveron="fills", text=_hover(tname, b, one_d), hoverinfo="text",
        meta={"tensor": tname, "ranks": list(b.ranks), "kind": b.kind,
              "rows": list(b.rows), "cols": list(b.cols)},
        **look)


def _panel_axes(fig, shape, bl: list[Block], one_d: bool, xmax, row: int, col: int) -> None:
    """A panel's axes: ticks at the blocks' edges, rows downwards."""
    xticks = sorted({v for b in bl for v in b.cols})
    fig.update_xaxes(range=[-0.01 * xmax, xmax * 1.01], tickvals=xticks, showgrid=False,
                     zeroline=False, title_text="index (dim 0)" if one_d and shape
                     else "column (dim 1)" if shape else "", row=row, col=col)
    if one_d:
        fig.update_yaxes(range=[2.5, -1.5], showticklabels=False, showgrid=False,
                         zeroline=False, row=row, col=col)
    else:
        yticks = sorted({v for b in bl for v in b.rows})
        fig.update_yaxes(range=[shape[0] * 1.01, -0.01 * shape[0]], tickvals=yticks,
                         showgrid=False, zeroline=False, title_text="row (dim 0)",
                         row=row, col=col)
