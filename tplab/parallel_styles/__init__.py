"""ParallelStyles torch does not ship, for the layouts today's models publish.

transformers 5.x plans Qwen3, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek and the rest with some
styles that have no torch DTensor equivalent (transformers/distributed/tensor_parallel.py).
Each is a small `torch.distributed.tensor.parallel.ParallelStyle` here (one method,
`_apply(module, mesh)`, as torch's own), built from the same two conjugate operators the
lessons teach (Shoeybi et al. 2019, section 3), as Functions that carry their reason
(`ctx.tp_cause`): f (identity forward, all-reduce backward) and g (all-reduce forward,
identity backward).

- `ReplicatedGradAllReduce`: a replicated weight applied to head-sharded activations
  (Qwen3's q_norm/k_norm): each rank's gradient covers its own heads only, so it is summed
  over the tp group after backward. This is f in its weight form.
- `PackedColwise` / `PackedRowwise`: a weight that stacks sub-matrices (gate and up, or q, k
  and v) split so that each rank holds its slice of EVERY sub-matrix (torch's
  `_StridedShard`), where a plain `Shard(0)` would give rank 0 all of gate, rank 1 all of up.
- `MoEExperts`: every rank runs its slice of every expert; f on the tokens and routing
  weights, g on the summed output.
- `ShardParameters` (bare parameters, such as stacked expert weights), `LocalParams`
  (forward on the local shards), `AllReduceOutput` (g), `MlaKvAProj` (f on the RoPE part of
  DeepSeek's MLA projection), `ScaleInput` (an identity expert inside a summed MoE), and
  `Styles` (several styles on one module, in order).
- `UnitColwise` / `UnitRowwise` (tplab.parallel_styles.heads): a projection split by whole
  heads on a (groups, replicas) view of the tp ranks (`unit_mesh`), so fewer key/value
  heads than ranks each live on several ranks (transformers 5.25's `unit_colwise`).

Each style declares what it does once, as a `tplab.style_specs.StyleSpec` (`spec(module,
tp)`): the placements it gives, what it reads and hands on, what tp must divide, and the
collective each pass issues and why. `describe_plan`, `plan_check` and the trace's causes
read it; each collective carries its spec's reason (`ctx.tp_cause`, `copy_with_cause`,
`reduce_with_cause`), which `tplab.trace` shows as the record's cause.
"""

from tplab.parallel_styles.activations import (
    AllReduceOutput,
    MlaKvAProj,
    MoEExperts,
    PackedColwise,
    ScaleInput,
    packed_rows,
)
from tplab.parallel_styles.explained import copy_with_cause, reduce_with_cause
from tplab.parallel_styles.heads import UnitColwise, UnitRowwise, unit_mesh
from tplab.parallel_styles.weights import (
    REPLICATED_GRAD_RULE,
    LocalParams,
    PackedRowwise,
    ReplicatedGradAllReduce,
    ShardParameters,
    Styles,
    TplabStyle,
    packed_placement,
)

__all__ = ["REPLICATED_GRAD_RULE", "AllReduceOutput", "LocalParams", "MlaKvAProj", "MoEExperts",
           "PackedColwise", "PackedRowwise", "ReplicatedGradAllReduce", "ScaleInput",
           "ShardParameters", "Styles", "TplabStyle", "UnitColwise", "UnitRowwise",
           "copy_with_cause", "packed_placement", "packed_rows", "reduce_with_cause",
           "unit_mesh"]
