"""The look shared by every tplab figure: one colour per rank, per phase, per collective.

Rank colours are soft (ColorBrewer Set2, then Set3) because they fill large areas
(shards, lanes) with text on top; phase colours are dark and saturated so that forward
and backward never read as a rank. Every figure takes its colours from here, so rank 2
is the same colour in a sharding map, a timeline and a widget.
"""

from __future__ import annotations

import plotly.graph_objects as go

from tplab.core import ops

RANK_COLORS = (
    "#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3",
    "#8dd3c7", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#bc80bd",
)

PHASE_COLORS = {"forward": "#1f4e9c", "backward": "#b2182b"}

SHARED_COLOR = "#eeeeee"  # fill of a block that several ranks hold (hatched on top)
OK_COLOR = "#2e7d32"
BAD_COLOR = "#c62828"
EXACT_COLOR = "#616161"
NODE_COLOR = "#f5f5f5"

# Normalised op name -> (short label drawn on a bar, marker symbol, words for hover).
OPS = {op.name: (op.label, op.symbol, op.words) for op in ops.TABLE.values()}

FONT = {"family": "Helvetica, Arial, sans-serif", "size": 14}

# The look of a mesh dim's groups wherever they show: (fill pattern of a box in
# comm_timeline, dash of a group's outline in mesh_map, colour of that outline).
GROUP_LOOKS = (("", "solid", "#54278f"), ("/", "dash", "#00695c"), ("x", "dot", "#8c510a"),
               (".", "dashdot", "#424242"))


def rank_color(rank: int) -> str:
    """The colour of `rank` in every figure (cycles after 16 ranks)."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def op_label(op: str) -> str:
    return OPS.get(op, (op, "circle", op))[0]


def op_symbol(op: str) -> str:
    return OPS.get(op, (op, "circle", op))[1]


def op_words(op: str) -> str:
    return OPS.get(op, (op, "circle", op.replace("_", "-")))[2]


def group_order(names) -> list[str]:
    """Group (mesh dim) names in the order figures list them: "tp", "dp", then the rest."""
    return sorted(set(names), key=lambda n: ({"tp": 0, "dp": 1}.get(n, 2), n))


def group_look(name: str, names) -> tuple[str, str, str]:
    """(pattern, dash, colour) of group `name` among `names`, in `group_order`: tp and dp
    look the same in every figure."""
    return GROUP_LOOKS[group_order([*names, name]).index(name) % len(GROUP_LOOKS)]


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable; keeps type checkers calm


def style(fig: go.Figure, title: str, subtitle: str | None = None, **layout) -> go.Figure:
    """Apply the shared template, font and title to `fig` and return it."""
    text = f"{title}<br><sup>{subtitle}</sup>" if subtitle else title
    fig.update_layout(
        template="plotly_white",
        font=FONT,
        title={"text": text, "x": 0.01, "xanchor": "left", "font": {"size": 20}},
        hoverlabel={"font": {"size": 13}},
        **layout,
    )
    return fig
