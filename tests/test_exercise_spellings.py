"""Issue 38 items 9 and 10: an exercise takes a right answer however torch spells it."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import tplab
from tplab import exercises
from tplab.core.placements import canonical

STRIDED = _StridedShard(0, split_factor=2)


@pytest.mark.parametrize("said, truth", [
    ("Shard(dim=0)", "Shard(0)"), (Shard(0), "Shard(0)"), ("S(0)", "Shard(0)"),
    (repr(STRIDED), "_StridedShard(dim=0, split_factor=2)"),
    (STRIDED, "_StridedShard(dim=0, split_factor=2)"),
    (str(STRIDED), "_StridedShard(dim=0, split_factor=2)"),
    (Replicate(), "Replicate()"), ("R", "Replicate()"),
])
def test_torchs_spellings_name_the_same_placement(said, truth):
    assert canonical(said) == canonical(truth)


@pytest.mark.parametrize("wrong, truth", [
    ("Shard(1)", "Shard(0)"),
    ("_StridedShard(dim=0, sf=4)", "_StridedShard(dim=0, split_factor=2)"),
    ("Shard(0)", "_StridedShard(dim=0, split_factor=2)"), ("Replicate()", "Shard(0)")])
def test_different_placements_stay_different(wrong, truth):
    assert canonical(wrong) != canonical(truth)


def test_fsdp_placements_passes_an_answer_in_torchs_own_repr():
    sim = tplab.simulate(2)
    answer = {"attention.wq.weight": {"dp": repr(STRIDED), "tp": Shard(0)},
              "attention.wo.weight": {"dp": "Shard(dim=0)", "tp": "Shard(dim=1)"},
              "attention_norm.weight": {"dp": Shard(0)}}
    fb = exercises.check("fsdp_placements", answer, sim)
    assert fb.passed, fb.message
    answer["attention.wo.weight"]["tp"] = "Shard(dim=0)"
    fb = exercises.check("fsdp_placements", answer, sim)
    assert not fb.passed and "attention.wo.weight on tp" in fb.message


def test_block_counts_takes_a_whole_float():
    sim = tplab.simulate(2)
    right = exercises.reference_answer("block_counts", sim)
    as_floats = {phase: {op: float(n) for op, n in counts.items()}
                 for phase, counts in right.items()}
    fb = exercises.check("block_counts", as_floats, sim)
    assert fb.passed, fb.message
    half = {phase: {op: n + 0.5 for op, n in counts.items()} for phase, counts in right.items()}
    fb = exercises.check("block_counts", half, sim)
    assert not fb.passed and "whole number" in fb.message
