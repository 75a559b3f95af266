"""Figures made in the notebook from data the ranks return (never drawn on a rank).

- `sharding_map`: which rank holds which block of a DTensor or of a model's parameters.
- `mesh_map`: the ranks of a 1-D or 2-D mesh, and the groups of each mesh dim.
- `comm_timeline`: per-rank lanes of the collectives in a trace.
- `grad_flow`: the modules in order, collectives on the forward and backward edges (f, g);
  `forward_stages(model, x)` gives it the model's order and its parallel branches.
- `grad_error`: a grad_check report's errors on a log scale, with the tolerance.

Colours come from `tplab.viz.palette`, so a rank has one colour in every figure; `style`
gives a notebook's own figures the same look, `human_bytes` writes sizes as they do.
"""

from tplab.viz.check import grad_error
from tplab.viz.edges import forward_stages
from tplab.viz.flow import grad_flow
from tplab.viz.mesh import mesh_map
from tplab.viz.palette import PHASE_COLORS, human_bytes, rank_color, style
from tplab.viz.sharding import sharding_map
from tplab.viz.timeline import comm_timeline

__all__ = ["PHASE_COLORS", "comm_timeline", "forward_stages", "grad_error", "grad_flow",
           "human_bytes", "mesh_map", "rank_color", "sharding_map", "style"]
