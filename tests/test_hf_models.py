"""Every transformers decoder with a published TP plan, built tiny and checked at world 2
both ways: transformers' own TP code and tplab's translation (docs/MODELS.md is this sweep,
written by scripts/models_table.py). A representative subset runs by default (dense, GQA,
QK-norm, MoE with packed experts); the whole sweep is extended."""

from __future__ import annotations

import pytest

import tplab
from tplab import hf_models

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sim2():
    transformers.logging.set_verbosity_error()
    return tplab.simulate(2)


@pytest.mark.parametrize("name", hf_models.DEFAULT_FAMILIES)
def test_a_family_is_right_both_ways(sim2, name):
    row = hf_models.check_family(sim2, name)
    assert row["buildable"], row["reason"]
    assert row["own"] == "ok" and row["from_hf"] == "ok", row
    # one g per row-parallel region forward (o_proj, and down_proj or the experts' sum)
    assert row["forward"] == "2 all_reduce", row
    assert "all_reduce" in row["backward"]


def test_the_sweep_covers_every_decoder_with_a_plan():
    names = hf_models.decoder_families()
    assert set(hf_models.DEFAULT_FAMILIES) <= set(names)
    assert len(names) > 100  # transformers 5.24: 116
    with pytest.raises(ValueError, match="name: 'no_such_model'"):
        hf_models.tiny_config("no_such_model")


@pytest.mark.extended
@pytest.mark.parametrize("name", hf_models.decoder_families())
def test_every_family_gets_the_same_verdict_both_ways(sim2, name):
    row = hf_models.check_family(sim2, name, trace_layer=False)
    if not row["buildable"]:
        pytest.skip(f"not buildable small: {row['reason']}")
    # tplab's translation computes what transformers' own code computes, right or wrong
    assert (row["own"] == "ok") == (row["from_hf"] == "ok"), row
