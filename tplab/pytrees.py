"""Inputs and outputs of any model as trees of tensors: tensors, tuples, lists, dicts,
dataclasses, and transformers' `ModelOutput` (an OrderedDict that is also a dataclass;
its None fields are left out, as its own `.keys()` does). Like `torch.utils._pytree`,
but with readable paths: "output.logits", "input[0]", "output['hidden']".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


def _key(k) -> str:
    return f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]"


def leaves(obj, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in `obj`, in order; other values are skipped."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, Mapping):
        return [x for k, v in obj.items() for x in leaves(v, path + _key(k))]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj)
                for x in leaves(getattr(obj, f.name), f"{path}.{f.name}")]
    if isinstance(obj, (tuple, list)):
        return [x for i, v in enumerate(obj) for x in leaves(v, f"{path}[{i}]")]
    return []


def map_tensors(fn, obj):
    """`obj` with every tensor t replaced by fn(t), the containers rebuilt as they were."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(**items) if dataclasses.is_dataclass(obj) else type(obj)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def call_model(model, x):
    """model(x) for a tensor or another pytree; model(*x) for a tuple or list; model(**x)
    for a dict (a batch, as transformers models take it)."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return model(*x)
    return model(x)
