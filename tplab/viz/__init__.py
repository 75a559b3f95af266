"""Figures made in the notebook from data the ranks return (never drawn on a rank).

- `sharding_map`: which rank holds which block of a DTensor or of a model's parameters.
- `comm_timeline`: per-rank lanes of the collectives in a trace.
- `grad_flow`: the modules in order, collectives on the forward and backward edges (f, g).
- `grad_error`: a grad_check report's errors on a log scale, with the tolerance.

Colours come from `tplab.viz.palette`, so a rank has one colour in every figure.
"""

from tplab.viz.check import grad_error
from tplab.viz.flow import grad_flow
from tplab.viz.palette import PHASE_COLORS, rank_color
from tplab.viz.sharding import sharding_map
from tplab.viz.timeline import comm_timeline

__all__ = ["PHASE_COLORS", "comm_timeline", "grad_error", "grad_flow", "rank_color",
           "sharding_map"]
