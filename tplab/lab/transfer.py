"""Moving results from ranks to the notebook.

torch's own pickling of tensors is slow through ipyparallel (about 10x numpy for
4 MB, see docs/DESIGN.md), so a rank turns every tensor into a numpy array, which
ipyparallel sends zero-copy, and the notebook turns it back. A DTensor comes back
as a `LocalShard`: this rank's block plus where it sits in the global tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

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


def placement_name(p) -> str:
    """"Shard(0)", "Replicate()", "Partial(sum)": the spelling of torch's constructors
    (str() of a placement gives the terse "S(0)", "R", "P(sum)")."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return repr(p)


def describe_dtensor(dt, rank: int, local: torch.Tensor | None = None) -> LocalShard:
    """`LocalShard` for a DTensor on `rank`; `local` overrides its local tensor (simulation)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dt.device_mesh
    coord = mesh.get_coordinate() or ()
    _, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
    return LocalShard(
        local=(local if local is not None else dt.to_local()).detach(),
        placements=tuple(placement_name(p) for p in dt.placements),
        global_shape=tuple(dt.shape),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        coordinate=tuple(coord),
        rank=rank,
        requires_grad=dt.requires_grad,
        offsets=tuple(int(o) for o in offsets),
    )


def pack(obj, rank: int):
    """Rank side: replace tensors (at any depth of lists, tuples, dicts) by numpy arrays."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        shard = describe_dtensor(obj, rank)
        shard.local = _pack_tensor(shard.local)
        return shard
    if isinstance(obj, torch.Tensor):
        return _pack_tensor(obj)
    if isinstance(obj, list):
        return [pack(o, rank) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(pack(o, rank) for o in obj)
    if isinstance(obj, dict):
        return {k: pack(v, rank) for k, v in obj.items()}
    return obj


def unpack(obj):
    """Notebook side: the inverse of `pack`."""
    if isinstance(obj, _PackedTensor):
        return _unpack_tensor(obj)
    if isinstance(obj, LocalShard):
        if isinstance(obj.local, _PackedTensor):
            obj.local = _unpack_tensor(obj.local)
        return obj
    if isinstance(obj, list):
        return [unpack(o) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(unpack(o) for o in obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    return obj


# --- the wire: how a rank's reply travels -------------------------------------------------

WIRE_TAG = "tplab-wire-1"


def to_wire(obj) -> tuple:
    """Rank side: pickle `obj` with its arrays out of band (pickle protocol 5), as a tuple
    (tag, header, array, ...) that ipyparallel sends with every array as a zero-copy frame.
    cloudpickle, so that instances of classes defined in the notebook come back too."""
    import cloudpickle

    buffers: list = []
    header = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return (WIRE_TAG, header, *(np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers))


def is_wire(message) -> bool:
    return isinstance(message, tuple) and len(message) >= 2 and message[0] == WIRE_TAG


def from_wire(message: tuple):
    """Notebook side: the inverse of `to_wire`."""
    import pickle

    return pickle.loads(message[1], buffers=[memoryview(b) for b in message[2:]])
