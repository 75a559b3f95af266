"""Small models for the lessons: MLP, Attention, Block, TinyLM (nanoGPT / Llama style).

Every model is built from a `Config` and initialised deterministically from `cfg.seed`,
so that the notebook (the single-device reference) and every rank build the same weights.
Module names follow torchtitan's Llama (wq/wk/wv/wo, w1/w2/w3, attention_norm, ffn_norm,
tok_embeddings, output), so the plans in `tplab.plans` read like torchtitan's.

Weights and inputs are made outside any rank-dependent randomness: inside
`tplab.simulate`, a random op under LocalTensorMode may give each simulated rank different
values; here they are made with that mode switched off, so every rank sees the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# rank_free_randomness: re-exported, tplab.models.rank_free_randomness is where lessons find it
from tplab.core.rng_streams import Dropout, RNGTracker, rank_free_randomness  # noqa: F401


@dataclass
class Config:
    """Sizes of the lab's models; the defaults run in milliseconds on a CPU."""

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 64  # feed-forward width
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads (None: n_heads)
    seq_len: int = 8
    batch_size: int = 2
    norm_eps: float = 1e-6
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic init from `seed`, in `named_parameters` order.

    Matrices ~ N(0, 1/fan_in) keep activations O(1); biases and norm weights are random
    too (not 0 and 1), so that a bias added twice or a norm gradient left partial shows.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad(), rank_free_randomness():
        for m in model.modules():
            for p in m.parameters(recurse=False):
                if p.ndim >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
                elif isinstance(m, nn.RMSNorm):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


class _Built(nn.Module):
    """Builds its layers with rank-dependent randomness off, then inits from cfg.seed."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        with rank_free_randomness():
            self.build(cfg)
        init_weights(self, cfg.seed)

    def build(self, cfg: Config) -> None:
        raise NotImplementedError


class MLP(_Built):
    """Two linears around a GELU: the smallest thing TP splits (Megatron's MLP block)."""

    def build(self, cfg: Config) -> None:
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, d) @ (d, h) -> (b, s, h) -> gelu -> (b, s, h) @ (h, d) -> (b, s, d)
        return self.w2(F.gelu(self.w1(x)))


class FeedForward(_Built):
    """SwiGLU feed-forward (Llama): w2(silu(w1 x) * w3 x)."""

    def build(self, cfg: Config) -> None:
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, d) @ (d, h) -> (b, s, h), twice; (b, s, h) @ (h, d) -> (b, s, d)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PackedFeedForward(_Built):
    """SwiGLU with gate and up packed in one linear, as Phi-3 and transformers' MoE experts
    store them: gate_up(x) = [gate(x), up(x)] on the last dim, then down(silu(gate) * up).
    Splitting gate_up like one matrix (Shard(0)) gives rank 0 gate's rows and rank 1 up's
    at tp 2; `parallel_styles.PackedColwise` gives each rank a slice of each."""

    def build(self, cfg: Config) -> None:
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, d) @ (d, 2h) -> (b, s, 2h) -> gate, up: (b, s, h) each -> (b, s, d)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(_Built):
    """Causal multi-head self-attention with separate q, k, v and output projections.

    Under TP each rank holds n_heads / tp heads: the views below use -1 for the number
    of heads, so the same code runs on the full model and on a shard. With
    `cfg.n_kv_heads` (grouped-query attention, as Llama 3: Ainslie et al. 2023) k and v
    have fewer heads, each shared by n_heads / n_kv_heads query heads (repeated here, as
    Llama's `repeat_kv`); under TP a rank holds n_kv_heads / tp of them.
    """

    def build(self, cfg: Config) -> None:
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        if cfg.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads = {cfg.n_heads} must be a multiple of n_kv_heads = "
                             f"{self.n_kv_heads}")
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, d) @ (d, h*hd) -> (b, s, h, hd) -> (b, h, s, hd)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if q.shape[1] != k.shape[1]:  # GQA: each k, v head serves a group of query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        # (b, h, s, hd) @ (b, h, hd, s) -> (b, h, s, s) -> softmax @ (b, h, s, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, h*hd)
        return self.wo(y)  # (b, s, h*hd) @ (h*hd, d) -> (b, s, d)


class Block(_Built):
    """Pre-norm transformer block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def build(self, cfg: Config) -> None:
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class DropoutBlock(Block):
    """A Block with hidden dropout (Megatron-LM's, on the residual stream after attention
    and after the feed-forward layer: OUTSIDE the TP regions), its masks drawn from a
    `tplab.rng.Dropout` stream: `region="replicated"` is right (the same mask on every
    rank); `"tp"` is the bug of a per-rank seed (each rank drops different elements)."""

    def __init__(self, cfg: Config, p: float = 0.1, region: str = "replicated",
                 seed: int = 1234):
        super().__init__(cfg)
        self.hidden_dropout = Dropout(p, region, RNGTracker(None, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.hidden_dropout(self.attention(self.attention_norm(x)))
        return h + self.hidden_dropout(self.feed_forward(self.ffn_norm(h)))


class TinyLM(_Built):
    """Token embedding, n_layers blocks, a final norm and the lm head (no position encoding:
    the causal mask is enough for a lab model). forward(tokens (b, s)) -> logits (b, s, vocab).
    """

    def build(self, cfg: Config) -> None:
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (b, s) -> (b, s, d)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (b, s, d) @ (d, vocab) -> (b, s, vocab)


def make_input(cfg: Config, *, seed: int | None = None) -> torch.Tensor:
    """Activations (batch_size, seq_len, dim) for MLP, Attention and Block; same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 1 if seed is None else seed)
    with rank_free_randomness():
        return torch.randn(cfg.batch_size, cfg.seq_len, cfg.dim, generator=g)


def make_tokens(cfg: Config, *, seed: int | None = None) -> torch.Tensor:
    """Token ids (batch_size, seq_len) for TinyLM; same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 2 if seed is None else seed)
    with rank_free_randomness():
        return torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the last position predicts the first: a lab simplification
    that keeps shapes whole). Works on vocab-sharded DTensor logits under `loss_parallel()`.
    """
    targets = tokens.roll(-1, dims=1)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
