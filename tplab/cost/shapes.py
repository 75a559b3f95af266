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
