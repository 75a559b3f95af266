"""The shapes the cost model prices: `BlockShape` (a transformer block and its micro-batch),
`MODELS` (published shapes, each citing its paper) and `scaled` (a shape at another hidden
size). The memory, compute, communication and step models all read these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tplab.cost.validate import check_bool, check_int, check_type


@dataclass(frozen=True)
class BlockShape:
    """The dimensions of a transformer block and the micro-batch it processes."""

    hidden: int
    heads: int
    ffn: int | None = None           # default 4 * hidden
    kv_heads: int | None = None      # default heads (no grouped-query attention)
    gated: bool = False              # SwiGLU-style MLP: 3 matrices instead of 2
    seq: int = 4096
    batch: int = 1                   # sequences per micro-batch
    layers: int = 1
    dtype_bytes: int = 2             # bf16
    name: str = ""
    vocab: int = 0                   # embedding and lm head rows (0: blocks only)

    def __post_init__(self):
        for name in ("hidden", "heads", "seq", "batch", "layers", "dtype_bytes"):
            check_int(name, getattr(self, name))
        check_int("vocab", self.vocab, minimum=0)
        if self.ffn is not None:
            check_int("ffn", self.ffn)
        if self.kv_heads is not None:
            check_int("kv_heads", self.kv_heads)
        check_bool("gated", self.gated)
        check_type("name", self.name, str, "a string")
        if self.hidden % self.heads:
            raise ValueError(f"hidden = {self.hidden} must divide into heads = {self.heads} "
                             "heads of equal width")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads = {self.kv_heads} must divide heads = {self.heads}: "
                             "each KV head serves a whole group of query heads")

    @property
    def ffn_size(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        """The width of k (and of v): kv_heads heads as wide as the query heads, h_kv."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def activation_bytes(self) -> int:
        """T = b s h d: the size of every TP message of the block."""
        return self.tokens * self.hidden * self.dtype_bytes

    def with_(self, **changes) -> BlockShape:
        return replace(self, **changes)


MODELS: dict[str, BlockShape] = {
    # Llama 3 8B and 70B: "The Llama 3 Herd of Models" (2024), table 3.
    "Llama-3 8B": BlockShape(hidden=4096, heads=32, kv_heads=8, ffn=14336, gated=True,
                             layers=32, vocab=128256, name="Llama-3 8B"),
    "Llama-3 70B": BlockShape(hidden=8192, heads=64, kv_heads=8, ffn=28672, gated=True,
                              layers=80, vocab=128256, name="Llama-3 70B"),
    # GPT-3 style shape with f = 4h (Brown et al. 2020, table 2.1: 6.7B and 175B).
    "GPT-3 6.7B": BlockShape(hidden=4096, heads=32, layers=32, seq=2048, vocab=50257,
                             name="GPT-3 6.7B"),
    "GPT-3 175B": BlockShape(hidden=12288, heads=96, layers=96, seq=2048, vocab=50257,
                             name="GPT-3 175B"),
    # Llama 3.1 405B: "The Llama 3 Herd of Models" (2024), table 3.
    "Llama-3.1 405B": BlockShape(hidden=16384, heads=128, kv_heads=8, ffn=53248, gated=True,
                                 layers=126, vocab=128256, name="Llama-3.1 405B"),
    # Llama 2 13B and 70B: Touvron et al. 2023 and their Hugging Face configs
    # (intermediate_size 13824 and 28672; 70B has 8 KV heads; vocabulary 32000).
    "Llama-2 13B": BlockShape(hidden=5120, heads=40, ffn=13824, gated=True, layers=40,
                              vocab=32000, name="Llama-2 13B"),
    "Llama-2 70B": BlockShape(hidden=8192, heads=64, kv_heads=8, ffn=28672, gated=True,
                              layers=80, vocab=32000, name="Llama-2 70B"),
    # The GPT shapes of Korthikanti et al. 2022, Table 3 (vocabulary 51200, section 6).
    "GPT 22B": BlockShape(hidden=6144, heads=64, layers=48, seq=2048, vocab=51200,
                          name="GPT 22B"),
    "GPT 175B": BlockShape(hidden=12288, heads=96, layers=96, seq=2048, vocab=51200,
                           name="GPT 175B"),
    "GPT 530B": BlockShape(hidden=20480, heads=128, layers=105, seq=2048, vocab=51200,
                           name="GPT 530B"),
    "GPT 1T": BlockShape(hidden=25600, heads=160, layers=128, seq=2048, vocab=51200,
                         name="GPT 1T"),
    # MosaicML's MPT benchmark shapes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml:
    # d_model, n_layers; expansion 4, GELU, vocabulary 50368). The heads do not enter the
    # FLOPs or bytes at TP 1; the sizes reproduce the NumParams column of llm-foundry's
    # scripts/train/benchmarking/README.md (12 L h^2 + V h to 0.2%).
    # the three small ones (mpt-125m/350m/760m.yaml: d_model 768/1024/1536, n_layers
    # 12/24/24, n_heads 12/16/12)
    "MPT 125M": BlockShape(hidden=768, heads=12, layers=12, vocab=50368, name="MPT 125M"),
    "MPT 350M": BlockShape(hidden=1024, heads=16, layers=24, vocab=50368, name="MPT 350M"),
    "MPT 760M": BlockShape(hidden=1536, heads=12, layers=24, vocab=50368, name="MPT 760M"),
    "MPT 1B": BlockShape(hidden=2048, heads=16, layers=24, vocab=50368, name="MPT 1B"),
    "MPT 3B": BlockShape(hidden=2560, heads=20, layers=32, vocab=50368, name="MPT 3B"),
    "MPT 7B": BlockShape(hidden=4096, heads=32, layers=32, vocab=50368, name="MPT 7B"),
    "MPT 13B": BlockShape(hidden=5120, heads=40, layers=40, vocab=50368, name="MPT 13B"),
    "MPT 30B": BlockShape(hidden=7168, heads=64, layers=48, vocab=50368, name="MPT 30B"),
    "MPT 70B": BlockShape(hidden=8192, heads=64, layers=80, vocab=50368, name="MPT 70B"),
}


def scaled(shape: BlockShape, hidden: int, **changes) -> BlockShape:
    """`shape` at another hidden size: heads of the same width, the same ffn / hidden ratio,
    the same number of kv heads (at most the heads). Other fields may change too."""
    check_type("shape", shape, BlockShape, "a tplab.cost.BlockShape")
    check_int("hidden", hidden)
    width = shape.hidden // shape.heads
    if hidden % width:
        raise ValueError(f"hidden = {hidden} is not a whole number of {width}-wide heads "
                         f"(the head width of {shape.name or 'shape'})")
    heads = hidden // width
    return shape.with_(hidden=hidden, heads=heads,
                       kv_heads=math.gcd(shape.kv_heads or heads, heads),
                       ffn=round(shape.ffn_size * hidden / shape.hidden), **changes)
