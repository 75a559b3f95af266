"""Where a collective sits on the model's data flow: the modules' order, their branches, and
which edge of a module (input or output) each collective of a trace belongs to.

`grad_flow` draws what this file decides. The rules, in Megatron-LM's terms (Shoeybi et al.
2019, section 3): reductions follow the compute that made the partial sums (forward: a
module's output edge; backward: its input edge, the gradient flowing right to left), gathers
precede the compute that needs the whole (forward: input edge; backward: output edge). A
record with an "edge" key ("input" or "output") overrides the rule.

Siblings are modules that read the same input, such as attention's wq, wk, wv or SwiGLU's w1
and w3: drawn as parallel branches fed by one edge, each with its own edge besides. They come
from the model when the caller says so (`forward_stages`, or tuples in the module list), and
otherwise from the trace (`stages_from_trace`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tplab.core.ops import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tplab.viz.palette import op_words

REDUCTIONS = {ALL_REDUCE, REDUCE_SCATTER}

# (op, phase, side) -> (letter drawn, what it does, for the hover)
ROLES = {
    (ALL_REDUCE, "forward", "output"):
        ("g", "g: sums the partial outputs of a row-parallel layer"),
    (ALL_REDUCE, "backward", "input"):
        ("f", "f's backward: sums each rank's part of dL/dx for a column-parallel layer"),
    (ALL_GATHER, "forward", "input"):
        ("", "gathers the sequence shards of the input (sequence parallelism)"),
    (REDUCE_SCATTER, "backward", "input"):
        ("", "conjugate of the forward all-gather: sums dL/dx and scatters it by sequence"),
    (REDUCE_SCATTER, "forward", "output"):
        ("", "sums the partial outputs and scatters them by sequence (sequence parallelism)"),
    (ALL_GATHER, "backward", "output"):
        ("", "conjugate of the forward reduce-scatter: gathers dL/dy's sequence shards"),
}


def role(rec: dict, sd: str) -> tuple[str, str]:
    """(letter, words): "f", "g", "dW" or "" for the figure, and a sentence for the hover."""
    op, phase = rec.get("op"), rec.get("phase")
    if op == ALL_REDUCE and phase == "backward" and len(rec.get("shape") or []) <= 1:
        # activations are (batch, seq, dim): a 1-D message is a parameter's gradient
        return "dW", "sums a replicated weight's gradient (a norm under sequence parallelism)"
    return ROLES.get((op, phase, sd), ("", f"{op_words(op)} in the {phase} pass"))


def side(rec: dict) -> str:
    """"input" or "output": which edge of its module a collective sits on (see module doc)."""
    if rec.get("edge") in ("input", "output"):
        return rec["edge"]
    reduce, forward = rec.get("op") in REDUCTIONS, rec.get("phase") == "forward"
    return "output" if reduce == forward else "input"


def side_in_context(rec: dict, where: list[int], placed: list[tuple]) -> str:
    """`side`, but for a collective of a module that holds several drawn ones (a hook on a
    whole block, say) the order of the trace decides: in the forward pass, after its
    children's collectives means at its output; in the backward pass, after them means at
    its input (gradients flow from the output back). With nothing to compare, `side`.
    """
    if len(where) < 2 or rec.get("edge") in ("input", "output"):
        return side(rec)
    inner = set(where)
    seqs = [r.get("seq", 0) for r, w in placed if r is not rec and r.get("phase") ==
            rec.get("phase") and set(w) < inner]
    seq, forward = rec.get("seq", 0), rec.get("phase") == "forward"
    if any(s < seq for s in seqs):
        return "output" if forward else "input"
    if any(s > seq for s in seqs):
        return "input" if forward else "output"
    return side(rec)


def match(module: str, names: Sequence[str]) -> list[int]:
    """Indices of the listed modules that `module` is, sits inside, or contains.

    "" (the root, e.g. a hook on the whole model) contains every listed module.
    """
    if not module:
        return list(range(len(names)))
    if module in names:
        return [names.index(module)]
    inside = [i for i, n in enumerate(names) if n and module.startswith(n + ".")]
    if inside:
        return [max(inside, key=lambda i: len(names[i]))]
    suffix = [i for i, n in enumerate(names)
              if n and (module.endswith("." + n) or n.endswith("." + module))]
    if suffix:
        return suffix[:1]
    return [i for i, n in enumerate(names) if n.startswith(module + ".")]


def _merge(forward: list[str], backward: list[str]) -> list[str]:
    """Forward order, with names seen only in the backward pass put where it says.

    `backward` is in backward order (last module first). A backward-only name goes before
    the first forward-known name that the backward pass reaches before it, else after the
    last one it reaches after it, else first (f's all-reduce, at a column-parallel input,
    is the usual backward-only collective and precedes the row-parallel g).
    """
    order = list(forward)
    rev = backward[::-1]  # now in forward order
    for i, name in enumerate(rev):
        if name in order:
            continue
        later = [n for n in rev[i + 1:] if n in order]
        earlier = [n for n in rev[:i] if n in order]
        if later:
            order.insert(order.index(later[0]), name)
        elif earlier:
            order.insert(order.index(earlier[-1]) + 1, name)
        else:
            order.insert(0, name)
    return order


def module_order(recs: Sequence[dict]) -> list[str]:
    """The modules of a trace in forward order, inferred from the order of its collectives.

    Only a guess where a module shows up in the backward pass alone: pass `modules` to
    `grad_flow` for the model's real order.
    """
    recs = sorted(recs, key=lambda r: r.get("seq", 0))
    parent = lambda m: m.rpartition(".")[0]
    fwd, bwd = [], []
    for rec in recs:
        m = rec.get("module") or ""
        seen = fwd if rec.get("phase") == "forward" else bwd
        if m and m not in seen:
            seen.append(m)
    order = []
    for p in _merge(list(dict.fromkeys(map(parent, fwd))), list(dict.fromkeys(map(parent, bwd)))):
        order += _merge([m for m in fwd if parent(m) == p], [m for m in bwd if parent(m) == p])
    return order


# --- siblings ----------------------------------------------------------------------------

def split_modules(modules: Sequence) -> tuple[list[str], list[list[int]] | None]:
    """`grad_flow`'s module list -> (flat names, stages as lists of indices into them), or
    stages None when no item is a group (a tuple or list of sibling names)."""
    names: list[str] = []
    stages: list[list[int]] = []
    grouped = False
    for item in modules:
        group = [item] if isinstance(item, str) else list(item)
        grouped |= not isinstance(item, str)
        stages.append(list(range(len(names), len(names) + len(group))))
        names += [str(n) for n in group]
    return names, (stages if grouped else None)


def stages_from_trace(names: Sequence[str], placed: list[tuple[dict, list[int], str]]
                      ) -> list[list[int]]:
    """Group adjacent modules into siblings by what the trace shows of them.

    Adjacent modules under one parent are siblings when each has, on its own input edge,
    the same collectives (phase, op, shape, group), and the first has none on its output
    edge: a column-parallel layer that reads a replicated input reduces (f) or gathers (SP)
    it at its own input, and a layer that read its neighbour's sharded output instead would
    not need the same. Collectives of a parent (Megatron's f on a block) say nothing; give
    the model's structure for those (`forward_stages`). `placed`: (record, where, side).
    """
    own_in: list[set] = [set() for _ in names]
    own_out: list[set] = [set() for _ in names]
    for rec, where, sd in placed:
        if len(where) != 1 or where[0] >= len(names) or role(rec, sd)[0] == "dW":
            continue
        key = (rec.get("phase"), rec.get("op"), tuple(rec.get("shape") or ()), rec.get("group"))
        (own_in if sd == "input" else own_out)[where[0]].add(key)
    stages: list[list[int]] = []
    parent = lambda n: n.rpartition(".")[0]
    for i in range(len(names)):
        prev = stages[-1][-1] if stages else None
        if (prev is not None and own_in[i] and own_in[i] == own_in[prev]
                and not own_out[prev] and parent(names[i]) == parent(names[prev])):
            stages[-1].append(i)
        else:
            stages.append([i])
    return stages


def forward_stages(model: torch.nn.Module, *inputs, **kwargs) -> list[str | tuple[str, ...]]:
    """The leaf modules in the order one forward pass calls them, siblings as tuples.

    Siblings are consecutive leaves called on the very same input tensor: attention's
    ("wq", "wk", "wv"), SwiGLU's ("w1", "w3"). Pass the result to `grad_flow` as `modules`.
    Runs on the notebook's single-device model (under no_grad), never on a rank.
    """
    calls: list[tuple[str, object]] = []

    def hook(name):
        def record(module, args):
            if not any(n == name for n, _ in calls):
                calls.append((name, args[0] if args else None))
        return record

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
             if n and not any(m.children())]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    out: list[list[str]] = []
    for i, (name, x) in enumerate(calls):
        same = i and isinstance(x, torch.Tensor) and x is calls[i - 1][1]
        if same:
            out[-1].append(name)
        else:
            out.append([name])
    return [g[0] if len(g) == 1 else tuple(g) for g in out]
