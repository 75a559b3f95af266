"""Inputs and outputs of any model as trees of tensors: tensors, tuples, lists, dicts,
dataclasses, and transformers' `ModelOutput` (an OrderedDict that is also a dataclass;
its None fields are left out, as its own `.keys()` does). Like `torch.utils._pytree`,
but with readable paths: "output.logits", "input[0]", "output['hidden']".

This is tplab's one walker over containers: `items` lists a container's children,
`map_leaves` rebuilds one with its leaves replaced. `leaves` and `map_tensors` (the
models' inputs and outputs), `tplab.core.transfer.unsendable_part` (what will not pickle) and
`tplab.simulate`'s results (each simulated rank's view) all walk with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


def _key(k) -> str:
    return f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"


def _is_dataclass(obj) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def items(obj, path: str = "", *, python_keys: bool = False) -> list[tuple[str, object]] | None:
    """(path, value) of each child of a container: a Mapping's values, a dataclass's fields,
    a tuple's or list's items; None when `obj` is not a container. A mapping key that is an
    identifier reads `.key` ("output.logits"), or `['key']` with `python_keys` (as Python
    indexes it: "result['lock']")."""
    if isinstance(obj, Mapping):
        return [(path + (f"[{k!r}]" if python_keys else _key(k)), v) for k, v in obj.items()]
    if _is_dataclass(obj):
        return [(f"{path}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    return None


def _is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


def map_leaves(fn, obj, is_leaf=_is_tensor, *, into_dataclasses: bool = True):
    """`obj` with every leaf x (`is_leaf(x)`: a tensor by default) replaced by fn(x), the
    containers rebuilt as they were (a namedtuple, a ModelOutput and a dataclass keep their
    type); values that are neither stay as they are. `into_dataclasses=False` keeps a
    dataclass (other than a Mapping) whole."""
    def walk(x):
        if is_leaf(x):
            return fn(x)
        if isinstance(x, Mapping):
            kids = {k: walk(v) for k, v in x.items()}
            try:
                return type(x)(**kids) if dataclasses.is_dataclass(x) else type(x)(kids)
            except TypeError:
                return kids
        if into_dataclasses and _is_dataclass(x):
            return dataclasses.replace(x, **{f.name: walk(getattr(x, f.name))
                                             for f in dataclasses.fields(x) if f.init})
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (tuple, list)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def leaves(obj, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in `obj`, in order; other values are skipped."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    return [x for child_path, v in items(obj, path) or () for x in leaves(v, child_path)]


def map_tensors(fn, obj):
    """`obj` with every tensor t replaced by fn(t), the containers rebuilt as they were."""
    return map_leaves(fn, obj)


def call_model(model, x):
    """model(x) for a tensor or another pytree; model(*x) for a tuple or list; model(**x)
    for a dict (a batch, as transformers models take it)."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return model(*x)
    return model(x)
