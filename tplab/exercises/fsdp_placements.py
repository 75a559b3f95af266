"""The exercise "fsdp_placements" (notebook 13): the placements FSDP2 x TP leaves on a block.

torchtitan's order: `parallelize_module` on mesh["tp"] (plans.block()), then `fully_shard` on
mesh["dp"] (`tplab.fsdp.fsdp_tp`). FSDP2 shards dim 0 of every parameter over dp; where TP
already sharded dim 0, FSDP2's shard is of the tp rank's piece: `_StridedShard`. A parameter
outside the TP plan is a DTensor on the dp mesh alone. Checked against the ranks' own
DTensors, on 4 simulated ranks (dp=2 x tp=2) whatever the lab.
"""

from __future__ import annotations

import functools

import tplab
from tplab import fsdp, models, plans
from tplab.core import placements
from tplab.core.answers.solutions import FSDP_PLACEMENTS
from tplab.exercises.feedback import fail, run_on_ranks

NAMES = tuple(FSDP_PLACEMENTS)
TITLE = "Predict the placements of FSDP2 x TP"
TASK = ("tplab.models.Block under tplab.fsdp.fsdp_tp(tplab.plans.block()) on a (dp=2, tp=2) "
        f"mesh: for each of {', '.join(NAMES)}, a dict {{mesh dim: placement}} with "
        "torch's spelling ('Shard(0)', 'Replicate()', '_StridedShard(dim=0, split_factor=2)'"
        "; its repr and placement objects are fine too), one entry per mesh dim the "
        "parameter's DTensor lives on.")
HINTS = ("TP first: wq is ColwiseParallel (rows split over tp), wo RowwiseParallel "
         "(columns). The norm is not in the plan.",
         "FSDP2 then shards dim 0 of every parameter over dp. If tp already split dim 0, "
         "dp splits each tp rank's rows again: a strided shard. A parameter TP left alone "
         "lives on the dp mesh only.",
         "wq: {'dp': '_StridedShard(dim=0, split_factor=2)', 'tp': 'Shard(0)'}; wo: {'dp': "
         "'Shard(0)', 'tp': 'Shard(1)'}; attention_norm: {'dp': 'Shard(0)'}.")
def check_fsdp_placements(name, answer, lab=None):
    if not isinstance(answer, dict) or set(answer) != set(NAMES):
        raise fail(name, f"the answer is a dict with the keys {', '.join(NAMES)}, each a "
                         f"dict {{mesh dim: placement}}; got {answer!r:.120}")
    cfg = models.Config(dim=16, hidden_dim=32, n_heads=4, seq_len=4, batch_size=4)
    # 4 simulated ranks, whatever the lab: fully_shard places parameters there (only FSDP2's
    # forward needs processes), so the check runs beside a lab of any size
    real = run_on_ranks(name, tplab.simulate(4), fsdp.placements_after,
                        functools.partial(models.Block, cfg), fsdp.fsdp_tp(plans.block()), 2)[0]
    for param in NAMES:
        said = answer[param]
        if not isinstance(said, dict):
            raise fail(name, f"{param}: a dict {{mesh dim: placement}}, not {said!r}")
        want = real[param]
        if set(said) != set(want):
            raise fail(name, f"{param} is a DTensor on the mesh dims {sorted(want)}, not "
                             f"{sorted(said)}" + (": TP left it alone, so it lives on FSDP2's"
                                                  " dp mesh only" if set(want) == {"dp"}
                                                  else ""))
        for dim, placement in want.items():
            if placements.canonical(said[dim]) != placements.canonical(placement):
                why = (": FSDP2 shards dim 0 of the tp rank's piece, a strided shard"
                       if "Strided" in placement else "")
                raise fail(name, f"{param} on {dim}: you said {said[dim]!r}, the ranks hold "
                                 f"{placement}{why}")
    return f"right: {real[NAMES[0]]} for wq, {real[NAMES[1]]} for wo"
