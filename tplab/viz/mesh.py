"""`mesh_map`: the ranks of a 1-D or 2-D DeviceMesh as a grid, and the groups of each dim.

`tplab.make_mesh(dp=2, tp=2)` lays ranks out row by row, the last dim innermost (as
Megatron-LM and torchtitan do): a row is a group of the last dim (tp), a column a group of
the first (dp). A group of mesh dim d is the ranks whose coordinates differ only in d, the
ranks `mesh.get_group(d)` joins (torch.distributed.device_mesh.DeviceMesh).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from tplab.viz.palette import group_look, rank_color, style

INSET = 0.08  # gap around a rank's square


def _grid(shape: tuple[int, ...], ranks) -> list[list[int]]:
    """The ranks as rows (one row on a 1-D mesh); row-major when `ranks` is None."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    if ranks is None:
        return [[i * cols + j for j in range(cols)] for i in range(rows)]
    grid = [list(map(int, ranks))] if len(shape) == 1 else [list(map(int, r)) for r in ranks]
    if [len(r) for r in grid] != [cols] * rows:
        raise ValueError(f"ranks {ranks} do not have the mesh's shape {shape}")
    return grid


def _outline(fig, x0, x1, y0, y1, dim: str, names, index: int, ranks: list[int], where: str):
    _, dash, color = group_look(dim, names)
    fig.add_trace(go.Scatter(
        x=[x0, x1, x1, x0, x0], y=[y0, y0, y1, y1, y0], mode="lines",
        line={"color": color, "width": 3, "dash": dash}, hoverinfo="text",
        text=f"{dim} group {index}: ranks {', '.join(map(str, ranks))}",
        name=f"{dim} group ({where})", legendgroup=dim, showlegend=index == 0,
        meta={"dim": dim, "group": index, "ranks": ranks}))


def _squares(fig: go.Figure, grid, names, ndim: int) -> None:
    """Each rank's square, in its colour; its trace's `meta` holds rank and coordinate."""
    for i, row in enumerate(grid):
        for j, r in enumerate(row):
            coord = (i, j) if ndim == 2 else (j,)
            where = ", ".join(f"{n}={c}" for n, c in zip(names, coord, strict=True))
            x0, x1, y0, y1 = j + INSET, j + 1 - INSET, -i - INSET, -i - 1 + INSET
            fig.add_trace(go.Scatter(
                x=[x0, x1, x1, x0, x0], y=[y0, y0, y1, y1, y0], mode="lines", fill="toself",
                fillcolor=rank_color(r), line={"color": "white", "width": 1},
                hoveron="fills", hoverinfo="text", text=f"rank {r} at ({where})",
                name=f"rank {r}", showlegend=False, meta={"rank": r, "coordinate": coord}))


def mesh_map(shape: int | Sequence[int], dim_names: Sequence[str] | None = None, *,
             ranks: Sequence | None = None, title: str | None = None) -> go.Figure:
    """Draw the ranks of a mesh of `shape` (1-D or 2-D), each in its colour with its
    coordinate, and outline the groups of each mesh dim.

    `dim_names`: default ("tp",) on a 1-D mesh, ("dp", "tp") on a 2-D one. `ranks`: the
    rank at each coordinate, as `mesh.mesh.tolist()` gives it (default row-major, as
    `tplab.make_mesh` lays them out). Each rank's square is a trace whose `meta` holds rank
    and coordinate; each group's outline one whose `meta` holds dim, group and ranks.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise ValueError(f"mesh_map draws 1-D and 2-D meshes of positive sizes, not {shape}")
    names = tuple(dim_names) if dim_names is not None else ("dp", "tp")[-len(shape):]
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} dim names {names} for a {len(shape)}-D mesh {shape}")
    grid = _grid(shape, ranks)
    nrows, ncols = len(grid), len(grid[0])
    fig = go.Figure()
    _squares(fig, grid, names, len(shape))
    cells = [(j + 0.5, -i - 0.5, r, (i, j) if len(shape) == 2 else (j,))
             for i, row in enumerate(grid) for j, r in enumerate(row)]
    fig.add_trace(go.Scatter(
        x=[c[0] for c in cells], y=[c[1] for c in cells], mode="text", name="ranks",
        text=[f"<b>rank {r}</b><br>({', '.join(map(str, co))})" for *_, r, co in cells],
        textfont={"size": 14}, hoverinfo="skip", showlegend=False,
        meta=[{"rank": r, "coordinate": co} for *_, r, co in cells]))
    # The last dim's groups are the rows; on a 2-D mesh the first dim's are the columns.
    last = names[-1]
    for i, row in enumerate(grid):
        _outline(fig, -0.02, ncols + 0.02, -i - 0.03, -i - 0.97, last, names, i, row, "a row")
        fig.add_annotation(x=ncols + 0.1, y=-i - 0.5, text=f"{last} group {i}", xanchor="left",
                           showarrow=False, font={"color": group_look(last, names)[2]})
    if len(shape) == 2:
        first = names[0]
        for j in range(ncols):
            column = [row[j] for row in grid]
            _outline(fig, j + 0.04, j + 0.96, 0.14, -nrows - 0.14, first, names, j, column,
                     "a column")
            fig.add_annotation(x=j + 0.5, y=-nrows - 0.2, text=f"{first} group {j}",
                               yanchor="top", showarrow=False,
                               font={"color": group_look(first, names)[2]})
    fig.update_xaxes(visible=False, range=[-0.3, ncols + 1.3])
    fig.update_yaxes(visible=False, range=[-nrows - 0.6, 0.35], scaleanchor="x")
    size = " × ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
    groups = f"each row a {last} group" + (f", each column a {names[0]} group"
                                           if len(shape) == 2 else "")
    coords = f"({', '.join(names)})" if len(shape) == 2 else names[0]
    style(fig, title or f"The mesh: {size}", f"{coords} coordinates; {groups}",
          height=int(230 + 120 * (nrows + 0.95)), width=min(1100, int(330 + 150 * ncols)),
          legend={"orientation": "h", "y": -0.02, "yanchor": "top", "x": 0},
          margin={"t": 100, "l": 20, "r": 20, "b": 40 + 10 * math.ceil(len(names) / 2)})
    return fig
