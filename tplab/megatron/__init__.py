"""Megatron-LM's tensor parallelism written by hand: the conjugate operators and parallel layers.

Shoeybi et al., "Megatron-LM" (2019), section 3, and Korthikanti et al., "Reducing Activation
Recomputation" (2022) for sequence parallelism. Each autograd Function (operators.py) is one
operator of the papers; its docstring names the counterpart in
megatron/core/tensor_parallel/mappings.py. The parallel layers and `parallelize` (layers.py)
follow megatron/core/tensor_parallel/layers.py.

| function           | forward                  | backward                 | Megatron            |
|--------------------|--------------------------|--------------------------|---------------------|
| copy_to_tp         | identity                 | all-reduce               | f                   |
| reduce_from_tp     | all-reduce               | identity                 | g                   |
| scatter_to_tp      | split (keep my chunk)    | all-gather               | scatter             |
| gather_from_tp     | all-gather               | split                    | gather              |
| all_gather_seq     | all-gather on dim        | reduce-scatter on dim    | g (SP)              |
| reduce_scatter_seq | reduce-scatter on dim    | all-gather on dim        | g-bar (SP)          |

The SP names are Korthikanti et al.'s (section 4.2.2, Figure 5): g is the all-gather in the
forward pass and the reduce-scatter in the backward pass, entering a TP region (where f
was); g-bar is the reverse, leaving it (where Megatron-LM's first paper has its g).

Every function takes the mesh (or a process group) explicitly: no global singleton. Pass a
DeviceMesh inside `tplab.simulate`: the rank comes from `mesh.get_local_rank()`, which the
simulation answers for every rank at once.
"""

from tplab.megatron.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallelize,
)
from tplab.megatron.operators import (
    OPERATORS,
    AllGatherSeq,
    CopyToTP,
    CopyToTPNoReduce,
    GatherFromTP,
    ReduceFromTP,
    ReduceScatterSeq,
    ScatterToTP,
    all_gather_seq,
    all_reduce_grad,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_to_tp,
)
from tplab.mesh import split, tp_group, tp_mesh

__all__ = ["OPERATORS", "AllGatherSeq", "ColumnParallelLinear", "CopyToTP", "CopyToTPNoReduce",
           "GatherFromTP", "ReduceFromTP", "ReduceScatterSeq", "RowParallelLinear",
           "ScatterToTP", "VocabParallelEmbedding", "all_gather_seq", "all_reduce_grad",
           "copy_to_tp", "gather_from_tp", "parallelize", "reduce_from_tp", "reduce_scatter_seq",
           "scatter_to_tp", "split", "tp_group", "tp_mesh"]
