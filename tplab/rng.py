"""Randomness under tensor parallelism: Megatron-LM's RNG tracker, and a dropout that uses it.

g's identity backward (and every `Replicate()` placement) assumes that each rank computes
bit-identical values outside the TP regions: the residual stream, the norms, the loss. A
random op there breaks that silently if the ranks draw different numbers, for instance a
dropout after the attention or the MLP when every rank was seeded with its own rank: each
rank then drops different elements, the "replicated" activations differ, and nothing fails;
the replicas just drift apart (tplab.grad_check's `replica_spread` rows show it).

Megatron-LM keeps two random streams (megatron/core/tensor_parallel/random.py,
`model_parallel_cuda_manual_seed` and `CudaRNGStatesTracker`):

- the default generator, seeded with the SAME seed on every TP rank: dropout outside the TP
  regions (hidden dropout on the residual stream) draws the same mask everywhere;
- the "model-parallel-rng" stream, seeded `seed + 2718 + tp_rank`, entered with
  `get_cuda_rng_tracker().fork()`: dropout inside a TP region (on a rank's attention heads)
  draws a different mask on each rank, as the one device would on different heads.

`RNGTracker` is that pair of streams on CPU generators; `Dropout(p, region)` draws its mask
from the stream of its region ("replicated" or "tp"). Masks are drawn with rank-dependent
randomness switched off and every rank's "tp" mask is drawn on every rank, then each rank
picks its own, so that the same code runs in processes and in `tplab.simulate`.

Sequence parallelism (Korthikanti et al. 2022): the residual stream, and so every dropout
outside the TP regions, is sharded on the sequence: rank r holds tokens [r*s/tp,
(r+1)*s/tp). "The same seed outside the TP regions" then draws identical masks for
different tokens. Megatron-LM forks the TP stream for the whole block under SP
(megatron/core/transformer/transformer_block.py, `get_cuda_rng_tracker().fork()` around
the layers, and around embedding dropout): each rank its own mask, statistically what one
device does but not the same numbers. tplab instead draws the ONE-DEVICE mask of the whole
sequence on every rank and keeps its own sequence shard (`RNGTracker(sequence_parallel=
True)`, which `use_tracker` and `parallelize` set when the plan is sequence parallel), so a
run under SP matches one device bit for bit; it costs drawing s numbers where Megatron
draws s/tp.

One device against a TP run (`tplab.train_check`, `grad_check`): `reference_tracker(model,
tp)` gives the single-device model a tracker that draws each "tp" mask as the tp ranks do
(rank r's chunk from rank r's stream, on the Dropout's `dim`), so the reference draws the
same numbers as the ranks inside the TP regions too.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import SequenceParallel

# the streams live in a leaf that models builds on; they are public here (rng.Dropout)
from tplab.core.rng_streams import OFFSET, REGIONS, Dropout, RNGTracker, rank_free_randomness  # noqa: F401
from tplab.plans import parallelizer


def use_tracker(model: nn.Module, mesh, seed: int | None = 1234, *,
                sequence_parallel: bool = False) -> nn.Module:
    """Give every `Dropout` of `model` the ranks' tracker for `mesh` (Megatron-LM's
    `model_parallel_cuda_manual_seed(seed)`); `seed=None` keeps each Dropout's own seed
    (the one the single-device model was built with). `sequence_parallel=True` when the
    residual stream is sequence-sharded (see the module doc). Returns the model."""
    made: dict[int, RNGTracker] = {}
    for m in model.modules():
        if isinstance(m, Dropout):
            old = m.tracker
            if id(old) not in made:
                made[id(old)] = RNGTracker(mesh, old.seed if seed is None else seed,
                                           old.offset, sequence_parallel=sequence_parallel)
            m.tracker = made[id(old)]
    return model


def reference_tracker(model: nn.Module, tp: int) -> nn.Module:
    """Give the single-device `model`'s Dropouts a tracker that draws "tp"-region masks as
    `tp` ranks do (each Dropout keeps its seed); the reference of a TP run. Returns it."""
    made: dict[int, RNGTracker] = {}
    for m in model.modules():
        if isinstance(m, Dropout):
            old = m.tracker
            if id(old) not in made:
                made[id(old)] = RNGTracker(None, old.seed, old.offset, tp=tp)
            m.tracker = made[id(old)]
    return model


def is_sequence_parallel(plan) -> bool:
    """Whether `plan` shards the residual stream on the sequence: a dict with a
    `SequenceParallel` style, or a callable given `sequence_parallel=True`
    (`functools.partial(megatron.parallelize, sequence_parallel=True)`)."""
    if isinstance(plan, dict):
        return any(isinstance(style, SequenceParallel) for style in plan.values())
    return bool((getattr(plan, "keywords", None) or {}).get("sequence_parallel", False))


def parallelize(model: nn.Module, mesh, plan=None, seed: int | None = None,
                sequence_parallel: bool | None = None) -> nn.Module:
    """A `(model, mesh) -> model` plan for grad_check: `plan` (a dict for
    `tplab.apply_plan`, or a callable such as `tplab.megatron.parallelize`), then
    `use_tracker`. Use it as `functools.partial(rng.parallelize, plan=..., seed=...)`.
    `seed=None` keeps the seeds the model's Dropouts were built with (so that the ranks
    draw what one device draws); `sequence_parallel` defaults to what the plan says
    (`is_sequence_parallel`)."""
    sp = is_sequence_parallel(plan) if sequence_parallel is None else sequence_parallel
    if plan is not None:
        model = parallelizer(plan)(model, mesh)
    return use_tracker(model, mesh, seed, sequence_parallel=sp)
