"""Fixtures for the TP-core tests: the same test on simulated ranks and on rank processes.

`tp_lab` is a simulation (2 and 4 ranks) and, marked slow, a real lab of 2 and 4 processes
(the session's shared labs from conftest.py). Builders are functools.partial objects of
tplab functions, so that they travel to rank processes by reference.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tplab
from tplab import models

# small sizes: the cost of a simulated step is the number of ops, not their size
CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=4,
                    batch_size=2)

MODES = [pytest.param(("sim", 2), id="sim2"), pytest.param(("sim", 4), id="sim4"),
         pytest.param(("proc", 2), id="proc2", marks=pytest.mark.slow),
         pytest.param(("proc", 4), id="proc4", marks=pytest.mark.slow)]


def lab_of(request):
    """The simulation or the session's lab of rank processes that a MODES param names."""
    kind, world = request.param
    if kind == "sim":
        return tplab.simulate(world)
    return request.getfixturevalue("labs").get(world)


@pytest.fixture(scope="module", params=MODES)
def tp_lab(request):
    return lab_of(request)


def build(cls, cfg=CFG):
    return functools.partial(cls, cfg)


def activations(cfg=CFG):
    return functools.partial(models.make_input, cfg)


def tokens(cfg=CFG):
    return functools.partial(models.make_tokens, cfg)


def llama():
    """A one-layer transformers Llama built from a config (random weights, seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: the hf extra

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)
