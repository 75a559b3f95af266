"""Models built with the frameworks' own layers for tests/test_frameworks.py and notebook 14's
twins: Megatron-core layers, Megatron's GPTModel with its vocab-parallel loss, and the
layers of Meta's LLaMA reference code on fairscale. Each takes `bug=True` for its planted
bug. Build them after the framework's parallel state is up (the adapters' init)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tplab.frameworks import fairscale as ff
from tplab.frameworks import megatron as mf

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 16, 32, 2, 4


def normal(w: torch.Tensor) -> torch.Tensor:
    return nn.init.normal_(w, std=0.5)


class MegatronMLP(nn.Module):
    """Embedding -> column-parallel -> gelu -> row-parallel, as Megatron's MLP. The bug:
    the column-parallel layer's dgrad all-reduce switched off (`disable_grad_reduce`),
    so the embedding's gradient is each rank's part only."""

    def __init__(self, bug: bool = False):
        super().__init__()
        from megatron.core.tensor_parallel import (
            ColumnParallelLinear,
            RowParallelLinear,
            VocabParallelEmbedding,
        )
        cfg = mf.config()
        self.embed = VocabParallelEmbedding(VOCAB, DIM, init_method=normal, config=cfg)
        self.up = ColumnParallelLinear(DIM, HIDDEN, config=cfg, init_method=normal, bias=True,
                                       gather_output=False, disable_grad_reduce=bug)
        self.down = RowParallelLinear(HIDDEN, DIM, config=cfg, init_method=normal, bias=True,
                                      input_is_parallel=True, skip_bias_add=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.up(self.embed(tokens))
        out, _ = self.down(F.gelu(h))
        return out


def gpt(bug: bool = False) -> nn.Module:
    """Megatron's GPTModel (local layer spec, no Transformer Engine): 2 layers. With labels
    its output is the per-token loss of its vocab-parallel cross entropy. The bug: the
    first layer's MLP input (linear_fc1) with its dgrad all-reduce switched off."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = mf.config(TransformerConfig, num_layers=2, hidden_size=DIM, num_attention_heads=4,
                    ffn_hidden_size=HIDDEN, hidden_dropout=0.0, attention_dropout=0.0,
                    params_dtype=torch.float32, init_method_std=0.5)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    if bug:  # as ColumnParallelLinear(disable_grad_reduce=True) sets it at construction
        fc1 = model.decoder.layers[0].mlp.linear_fc1
        fc1.disable_grad_reduce, fc1.allreduce_dgrad = True, False
    return model


def gpt_input() -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": tokens, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
            # Megatron's convention, True where masked; its default (mask None) is made on CUDA
            "attention_mask": torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1),
            "labels": torch.roll(tokens, -1, 1)}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


class FairscaleFFN(nn.Module):
    """LLaMA's reference code on fairscale: token embedding split on its dim
    (ParallelEmbedding), the SwiGLU feed-forward (w1, w3 column-, w2 row-parallel), and the
    output head column-parallel with its logits gathered. The bug: w1 and w3 skip
    `copy_to_model_parallel_region` (their input's backward all-reduce dropped)."""

    def __init__(self, bug: bool = False):
        super().__init__()
        layers = ff.mp.layers
        column = functools.partial(layers.ColumnParallelLinear, bias=False,
                                   gather_output=False, init_method=normal)
        self.tok_embeddings = layers.ParallelEmbedding(VOCAB, DIM, init_method=normal)
        self.w1, self.w3 = column(DIM, HIDDEN), column(DIM, HIDDEN)
        self.w2 = layers.RowParallelLinear(HIDDEN, DIM, bias=False, input_is_parallel=True,
                                           init_method=normal)
        self.output = layers.ColumnParallelLinear(DIM, VOCAB, bias=False, init_method=normal)
        self.bug = bug

    def ffn_in(self, layer, x):
        if not self.bug:
            return layer(x)
        return F.linear(x, layer.weight)  # the region's copy (its backward reduce) dropped

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + self.w2(F.silu(self.ffn_in(self.w1, h)) * self.ffn_in(self.w3, h))
        return self.output(h)
