"""Placements by name: the strings trace records, `tp_layout` and `LocalShard` carry.

A record or a shard travels between the ranks and the notebook as plain data, so its
placements travel as the spelling of torch's constructors (docs/CONTRACTS.md):
"Shard(0)", "Replicate()", "Partial(sum)", "_StridedShard(dim=1, split_factor=2)"
(`torch.distributed.tensor.placement_types`). This module is the one place that writes,
reads and compares those names; it also reads the terse forms torch's `str()` prints
("S(0)", "R", "P(sum)") and the short ones figures draw. It imports torch's placement
types (both sides have torch), and nothing of either side.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

REPLICATE = "Replicate()"
PARTIAL = "Partial(sum)"
SHARD_KIND, REPLICATE_KIND, PARTIAL_KIND = "shard", "replicate", "partial"


def shard(dim: int) -> str:
    """"Shard(dim)": the name of torch's `Shard(dim)`."""
    return f"Shard({dim})"


def name(p) -> str:
    """"Shard(0)", "Replicate()", "Partial(sum)": the spelling of torch's constructors for
    a placement object (str() of a placement gives the terse "S(0)", "R", "P(sum)")."""
    if isinstance(p, Shard):
        return shard(p.dim)
    if isinstance(p, Replicate):
        return REPLICATE
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    if hasattr(p, "split_factor"):  # torch's _StridedShard: packed weights, FSDP2 x TP
        return f"_StridedShard(dim={p.dim}, split_factor={p.split_factor})"
    return repr(p)


# torch's terse str() of a placement ("S(0)", "_S(0, 2)", "R", "P(sum)") and its repr
# ("Shard(dim=0)", "_StridedShard(dim=0, sf=2)") name the same placements as the
# constructors' spelling ("Shard(0)", "_StridedShard(dim=0, split_factor=2)")
TERSE = {"S": "Shard", "_S": "_StridedShard", "R": "Replicate", "P": "Partial"}


def canonical(p) -> str:
    """One spelling of a placement written any way torch writes it (object, constructor,
    repr, str()): the class and its arguments' values, without keywords or spaces."""
    if not isinstance(p, str):
        p = name(p)
    head, paren, args = p.strip().partition("(")
    head = TERSE.get(head.strip(), head.strip())
    if not paren:
        return f"{head}()" if head == "Replicate" else p.strip()
    values = [a.split("=")[-1].strip() for a in args.rstrip().rstrip(")").split(",")]
    return f"{head}({','.join(v for v in values if v)})"


def parse(text: str) -> tuple[str, int | str | None]:
    """ "Shard(0)", "S(0)", "_S(0, 2)", "_StridedShard(dim=0, ...)" -> ("shard", 0);
    "Replicate()", "R" -> ("replicate", None); "Partial(sum)", "P(sum)" -> ("partial", "sum").
    """
    head, _, arg = str(text).strip().partition("(")
    head, arg = head.strip().lstrip("_"), arg.rstrip(")").strip()
    if head in ("S", "Shard", "StridedShard"):
        return SHARD_KIND, int(arg.split(",")[0].split("=")[-1])
    if head in ("R", "Replicate"):
        return REPLICATE_KIND, None
    if head in ("P", "Partial"):
        return PARTIAL_KIND, arg or "sum"
    raise ValueError(f"unknown placement {text!r}")


def shard_dim(text: str | None) -> int | None:
    """d for a plain "Shard(d)" (not a `_StridedShard`, whose pieces are not one chunk each),
    else None."""
    if not text or not text.startswith("Shard("):
        return None
    return int(text[len("Shard("):-1])


def is_shard(text: str | None) -> bool:
    """A plain "Shard(d)": each rank holds one chunk of dim d, in rank order."""
    return shard_dim(text) is not None


def is_partial(text: str | None) -> bool:
    """"Partial(...)": each rank holds a summand (or other reduction term) of the value."""
    return bool(text) and text.startswith("Partial")


def is_replicate(text: str | None) -> bool:
    return text == REPLICATE


def long(text: str) -> str:
    """The long form a learner reads in torch's docs: "S(0)" -> "Shard(0)"."""
    kind, arg = parse(text)
    return {SHARD_KIND: f"Shard({arg})", REPLICATE_KIND: REPLICATE}.get(kind, f"Partial({arg})")


def short(text: str) -> str:
    """The form figures draw: "Partial(sum) -> Replicate()" -> "P(sum)→R"."""
    for long_name, short_name in (("Partial(", "P("), (REPLICATE, "R"), ("Shard(", "S("),
                                  (" -> ", "→")):
        text = text.replace(long_name, short_name)
    return text


def placement(text: str | None):
    """The torch placement a name stands for: "Shard(0)" -> Shard(0), "Partial(sum)" ->
    Partial(), "Replicate()" or None -> Replicate()."""
    if text is None or is_replicate(text):
        return Replicate()
    if is_partial(text):
        return Partial(parse(text)[1])
    dim = shard_dim(text)
    if dim is None:
        raise ValueError(f"placement {text!r}: only Shard(d), Replicate() and Partial() "
                         f"are made from a name")
    return Shard(dim)
