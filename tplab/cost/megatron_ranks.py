"""Megatron-LM's pipeline ranks under the embedding/loss split: how many layers each model
chunk builds, how many layer-micro-batches a rank holds at its peak as Megatron's schedule
fills it, and a rank's own parameters (`tplab.cost.pipeline.held_layers`, `Stack.embedding_slot`).
Read in Megatron-LM at b0cc2706 (the submodule Megatron-Bridge v0.3.0 pins):
megatron/core/transformer/transformer_block.py `get_num_layers_to_build` and
megatron/core/pipeline_parallel/schedules.py `get_pp_rank_microbatches`,
`get_schedule_table`, `get_model_chunk_id`."""

from __future__ import annotations

import functools

from tplab.cost.kernels import local_params
from tplab.cost.memory import param_count


def chunk_layers(layers: int, pp: int, vpp: int, rank: int, chunk: int) -> int:
    """Layers model chunk `chunk` of pipeline rank `rank` builds when the embedding and the
    loss each take a layer's slot (Megatron-LM's `get_num_layers_to_build`,
    megatron/core/transformer/transformer_block.py at b0cc2706: (L + 2) / (p v) a chunk, one
    fewer in the first rank's first chunk and in the last rank's last)."""
    per = (layers + 2) // (pp * vpp)
    return per - (rank == 0 and chunk == 0) - (rank == pp - 1 and chunk == vpp - 1)


@functools.lru_cache(maxsize=4096)
def rank_peak_layers(layers: int, pp: int, vpp: int, m: int, rank: int) -> int:
    """Layer-micro-batches rank `rank` holds at its peak under Megatron-LM's schedule
    (megatron/core/pipeline_parallel/schedules.py at b0cc2706): `get_pp_rank_microbatches`'
    warm-up, 2 (p - r - 1) + (v - 1) p chunk-forwards interleaved (p - r - 1 without),
    capped at all m v; then one forward and one backward a step, the forwards' chunks in
    `get_schedule_table`'s order (groups of p micro-batches per chunk) and the backwards'
    reversed (`get_model_chunk_id`: v - 1 - chunk)."""
    total = m * vpp
    group = pp   # microbatch_group_size_per_vp_stage's default
    table = [chunk for start in range(0, m, group) for chunk in range(vpp)
             for _ in range(start, min(start + group, m))]
    size = [chunk_layers(layers, pp, vpp, rank, c) for c in range(vpp)]
    warm = min(total, 2 * (pp - rank - 1) + (vpp - 1) * pp if vpp > 1 else pp - rank - 1)
    held = sum(size[table[i]] for i in range(warm))
    peak = held
    for j in range(total - warm):
        held += size[table[warm + j]]
        peak = max(peak, held)
        held -= size[vpp - 1 - table[j]]
    return peak


def rank_params(run, rank: int | None) -> float:
    """Parameter elements of pipeline rank `rank` before any sharding: its chunks' layers
    (`chunk_layers`), the embedding on rank 0, the head and final norm on rank p - 1;
    rank None: 1/(t p) of the model (`kernels.local_params`)."""
    shape, pp, vpp = run.shape, run.pp, run.vpp
    if rank is None:
        return local_params(shape, run.tp, pp)
    built = sum(chunk_layers(shape.layers, pp, vpp, rank, c) for c in range(vpp))
    vocab = shape.vocab * shape.hidden / run.tp
    return (param_count(shape.with_(layers=built, vocab=0), run.tp)
            + (vocab if rank == 0 else 0) + (vocab + shape.hidden if rank == pp - 1 else 0))
