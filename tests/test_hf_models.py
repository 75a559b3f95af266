"""Every transformers decoder with a published TP plan, built tiny and checked at world 2
both ways: transformers' own TP code and tplab's translation (docs/MODELS.md is this sweep,
written by scripts/models_table.py). A representative subset runs by default (dense, GQA,
QK-norm, MoE with packed experts); the whole sweep is extended."""

from __future__ import annotations

import pytest

import tplab
from tplab import hf, hf_models

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sim2():
    transformers.logging.set_verbosity_error()
    return tplab.simulate(2)


# transformers' styles whose module sums its output over the tp ranks in the forward pass
# (g): a row-parallel layer, the MoE experts' sum, an explicit all-reduce
SUMMING_STYLES = {"rowwise", "rowwise_rep", "rowwise_split_input", "unit_rowwise",
                  "packed_rowwise", "moe_tp_experts", "all_reduce"}


def summing_modules(name: str) -> list[str]:
    """The modules of decoder layer 0 that the installed transformers' resolved plan (at 2
    ranks) gives a summing style: one forward all-reduce each. A rule on a bare parameter
    (the experts' down_proj weight) shards it; its module's own style does the sum."""
    model = hf_models.build(name)
    params = dict(model.named_parameters())
    return [k for k, style in hf.transformers_plan(model, 2).items()
            if ".layers.0." in k and k not in params and style in SUMMING_STYLES]


@pytest.mark.parametrize("name", hf_models.DEFAULT_FAMILIES)
def test_a_family_is_right_both_ways(sim2, name):
    row = hf_models.check_family(sim2, name)
    assert row["buildable"], row["reason"]
    assert row["own"] == "ok" and row["from_hf"] == "ok", row
    # one g per row-parallel region forward: o_proj, and down_proj or the experts' sum
    # where the plan shards them (transformers 5.25 leaves MoE experts whole under TP)
    summing = summing_modules(name)
    assert len(summing) >= 1 and any(k.endswith("o_proj") for k in summing), summing
    assert row["forward"] == f"{len(summing)} all_reduce", (row, summing)
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
