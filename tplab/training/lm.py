"""A small language model with dropout in both places Megatron-LM has it, and a data set made
in the notebook: what lesson 12 trains, and what tests train.

`DropoutLM` is `tplab.models.TinyLM` with embedding dropout and hidden dropout (on the
residual stream: OUTSIDE the TP regions, `hidden` = "replicated" is right) and a dropout
inside each SwiGLU feed-forward, on its hidden units (INSIDE a TP region, where each rank
holds hidden_dim / tp of them: `inner` = "tp" is right). All masks come from one
`tplab.rng` tracker; `rng.parallelize` gives the ranks theirs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tplab import models
from tplab.core.rng_streams import Dropout, RNGTracker


class DropoutFeedForward(models.FeedForward):
    """SwiGLU with dropout on the hidden units: w2(dropout(silu(w1 x) * w3 x))."""

    def __init__(self, cfg: models.Config, dropout: Dropout):
        super().__init__(cfg)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.dropout(F.silu(self.w1(x)) * self.w3(x)))


class DropoutLMBlock(models.Block):
    """A pre-norm block with hidden dropout after attention and after the feed-forward."""

    def __init__(self, cfg: models.Config, hidden: Dropout, inner: Dropout):
        self._dropouts = (hidden, inner)
        super().__init__(cfg)

    def build(self, cfg: models.Config) -> None:
        super().build(cfg)
        self.hidden_dropout = self._dropouts[0]
        self.feed_forward = DropoutFeedForward(cfg, self._dropouts[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.hidden_dropout(self.attention(self.attention_norm(x)))
        return h + self.hidden_dropout(self.feed_forward(self.ffn_norm(h)))


class DropoutLM(models.TinyLM):
    """TinyLM with dropout p: `hidden` region for embedding and residual dropout, `inner`
    for the feed-forward's hidden units (see the module doc); masks seeded with `seed`."""

    def __init__(self, cfg: models.Config, p: float = 0.1, hidden: str = "replicated",
                 inner: str = "tp", seed: int = 1234):
        tracker = RNGTracker(None, seed)
        self._dropouts = (Dropout(p, hidden, tracker), Dropout(p, inner, tracker, dim=-1))
        super().__init__(cfg)

    def build(self, cfg: models.Config) -> None:
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embedding_dropout = self._dropouts[0]
        self.layers = nn.ModuleList(DropoutLMBlock(cfg, *self._dropouts)
                                    for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding_dropout(self.tok_embeddings(tokens))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def counting_batches(cfg: models.Config, seed: int = 0):
    """`make_batch(i)`: step i's batch of a small deterministic data set made here (no
    download): each sequence counts up by a stride from a start, modulo the vocabulary,
    so that next-token prediction is learnable (the loss falls) in a few hundred steps."""
    def make_batch(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 100003 + i)
        with models.rank_free_randomness():
            start = torch.randint(cfg.vocab_size, (cfg.batch_size, 1), generator=g)
            stride = torch.randint(1, 4, (cfg.batch_size, 1), generator=g)
        return (start + stride * torch.arange(cfg.seq_len)) % cfg.vocab_size
    return make_batch
