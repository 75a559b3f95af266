"""Moving results from ranks to the notebook (used by both sides: the rank side packs,
the notebook side unpacks; nothing here belongs to either).

torch's own pickling of tensors is slow through ipyparallel (about 10x numpy for
4 MB, see docs/DESIGN.md), so a rank turns every tensor into a numpy array, which
ipyparallel sends zero-copy, and the notebook turns it back. A DTensor comes back
as a `LocalShard`: this rank's block plus where it sits in the global tensor.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import types
from dataclasses import dataclass, field

import cloudpickle
import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tplab.core import placements, pytrees

# numpy has no bfloat16 (or float8): send the bits as an integer array of the same width.
_BITCAST = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


@dataclass
class LocalShard:
    """One rank's piece of a DTensor, as the notebook sees it.

    `placements` are strings such as "Shard(0)", "Replicate()", "Partial(sum)", one per
    mesh dimension; `coordinate` is this rank's position on the mesh.
    """

    local: torch.Tensor
    placements: tuple[str, ...]
    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    coordinate: tuple[int, ...]
    rank: int
    requires_grad: bool = False
    offsets: tuple[int, ...] = field(default=())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.local.shape)


@dataclass
class _PackedTensor:
    array: np.ndarray
    dtype: str  # torch dtype name, e.g. "bfloat16"
    requires_grad: bool


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pack_tensor(t: torch.Tensor) -> _PackedTensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    base = _BITCAST.get(t.dtype)
    array = (t.view(base) if base is not None else t).contiguous().numpy()
    return _PackedTensor(array, _dtype_name(t.dtype), False)


def _unpack_tensor(p: _PackedTensor) -> torch.Tensor:
    array = p.array
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, order="C")  # a received buffer is read-only: own a copy
    # (np.ascontiguousarray would also turn a 0-d array, a loss, into shape (1,).)
    t = torch.from_numpy(array.reshape(p.array.shape))
    dtype = getattr(torch, p.dtype)
    return t.view(dtype) if t.dtype != dtype else t


def describe_dtensor(dt, rank: int, local: torch.Tensor | None = None) -> LocalShard:
    """`LocalShard` for a DTensor on `rank`; `local` overrides its local tensor (simulation)."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate() or ()
    _, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    return LocalShard(
        local=(local if local is not None else dt.to_local()).detach(),
        placements=tuple(placements.name(p) for p in dt.placements),
        global_shape=tuple(dt.shape),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        coordinate=tuple(coord),
        rank=rank,
        requires_grad=dt.requires_grad,
        offsets=tuple(int(o) for o in offsets),
    )


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the notebook receives it: waited on, detached, on the CPU, strided."""
    wait = getattr(t, "wait", None)
    if type(t).__name__ == "AsyncCollectiveTensor" and callable(wait):
        t = wait()
    if t.is_meta:
        raise TypeError(f"a meta tensor (shape {list(t.shape)}) has no data to send: "
                        "return its .shape, or build it on a real device")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t


# --- the wire: how a rank's reply travels -------------------------------------------------

WIRE_TAG = "tplab-wire-2"


def tensor_from_array(array: np.ndarray, dtype: str, shape: tuple) -> torch.Tensor:
    """Notebook side: a tensor from the array a rank sent (see `to_wire`)."""
    return _unpack_tensor(_PackedTensor(np.asarray(array).reshape(shape), dtype, False))


def sparse_from_parts(indices: torch.Tensor, values: torch.Tensor, shape: tuple,
                      layout: str) -> torch.Tensor:
    """Notebook side: a sparse tensor from its COO parts, in its original layout."""
    t = torch.sparse_coo_tensor(indices, values, shape, check_invariants=True).coalesce()
    return t if layout == "sparse_coo" else getattr(t, f"to_{layout}")()


def shard_from_wire(fields: dict) -> LocalShard:
    return LocalShard(**fields)


def _reduce_tensor(t: torch.Tensor, rank: int):
    if isinstance(t, DTensor):
        shard = describe_dtensor(t, rank)
        return shard_from_wire, ({f.name: getattr(shard, f.name)
                                  for f in dataclasses.fields(shard)},)
    t = _plain(t)
    if t.layout != torch.strided:
        layout = str(t.layout).removeprefix("torch.")
        coo = (t.to_sparse_coo() if layout != "sparse_coo" else t).coalesce()
        return sparse_from_parts, (coo.indices(), coo.values(), tuple(t.shape), layout)
    packed = _pack_tensor(t)
    return tensor_from_array, (packed.array.reshape(-1), packed.dtype, tuple(t.shape))


def to_wire(obj, rank: int = -1) -> tuple:
    """Rank side: pickle `obj` with tensors as numpy arrays sent out of band (pickle
    protocol 5), as a tuple (tag, header, array, ...) that ipyparallel sends with every
    array as a zero-copy frame. A tensor anywhere in `obj` (a list, a dict, a namedtuple,
    a dataclass, an object's attributes) travels this way; a DTensor becomes a
    `LocalShard`. cloudpickle, so that instances of notebook classes come back too."""
    for pickler in (_FastPickler, _wire_pickler()):  # plain pickle first: 10x faster
        buffers: list = []
        out = io.BytesIO()
        try:
            p = pickler(out, protocol=5, buffer_callback=buffers.append)
            p.rank = rank
            p.dump(obj)
            break
        except (pickle.PicklingError, AttributeError, TypeError):
            if pickler is not _FastPickler:
                raise
    return (WIRE_TAG, out.getvalue(), *(np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers))


class _FastPickler(pickle.Pickler):
    """The standard C pickler, with tensors sent as arrays (see _reduce_tensor)."""

    rank = -1

    def reducer_override(self, value):
        if isinstance(value, torch.Tensor):
            return _reduce_tensor(value, self.rank)
        if isinstance(value, type | types.FunctionType) and value.__module__ == "__main__":
            # defined in a cell: the notebook's __main__ may not have it; cloudpickle sends
            # it by value
            raise pickle.PicklingError("a class or function from __main__")
        return NotImplemented


_WIRE_PICKLER = []


def _wire_pickler():
    """cloudpickle with tensors sent as arrays: for results holding notebook classes or
    functions, which plain pickle cannot send by reference."""
    if not _WIRE_PICKLER:
        class WirePickler(cloudpickle.Pickler):
            rank = -1

            def reducer_override(self, value):
                if isinstance(value, torch.Tensor):
                    return _reduce_tensor(value, self.rank)
                return super().reducer_override(value)

        _WIRE_PICKLER.append(WirePickler)
    return _WIRE_PICKLER[0]


def unsendable_part(obj, rank: int = -1, path: str = "result") -> tuple[str, str, str]:
    """Where in `obj` pickling fails: (path, type name, error), e.g. ("result[2]['lock']",
    "_thread.lock", "TypeError: cannot pickle '_thread.lock' object")."""
    try:
        to_wire(obj, rank)
        return path, "", ""
    except Exception as exc:  # noqa: BLE001 - what fails is what we look for
        error = f"{type(exc).__name__}: {exc}"
    children = pytrees.items(obj, path, python_keys=True)
    if children is None:  # any other object: its attributes
        has_vars = hasattr(obj, "__dict__") and not isinstance(obj, type)
        children = [(f"{path}.{k}", v) for k, v in vars(obj).items()] if has_vars else []
    for child_path, child in children:
        found = unsendable_part(child, rank, child_path)
        if found[1]:
            return found
    kind = type(obj)
    return path, f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins."), error


def is_wire(message) -> bool:
    return isinstance(message, tuple) and len(message) >= 2 and message[0] == WIRE_TAG


def from_wire(message: tuple):
    """Notebook side: the inverse of `to_wire`."""
    return pickle.loads(message[1], buffers=[memoryview(b) for b in message[2:]])
