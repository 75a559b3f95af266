"""Named device meshes for the lab: `make_mesh(tp=4)` or `make_mesh(dp=2, tp=2)`.

Both sides (a rank, and a Simulation's ranks in the notebook). A thin layer over
`torch.distributed.device_mesh.init_device_mesh` that picks the lab's device type, names the
dimensions, and says clearly when the shape does not cover the world. Meshes are cached per
shape, so a cell that runs twice does not create new process groups every time. """

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tplab.errors import LabError

_MESHES: dict[tuple, DeviceMesh] = {}
# process group name -> mesh dim name, for traces: a 1-D mesh over the whole world reuses
# the default group, whose own description says nothing about "tp"
GROUP_NAMES: dict[str, str] = {}
# mesh["tp"] of a 2-D mesh, by id of the mesh (kept alive here): slicing a DeviceMesh costs
# milliseconds in torch 2.13 (measured here: 3 ms), and f, g and train_check's per-step
# comparison ask for it on every call
_TP_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def device_type() -> str:
    """The lab's device type: "cuda" when the ranks talk through NCCL, else "cpu"."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def make_mesh(tp: int | None = None, dp: int | None = None) -> DeviceMesh:
    """A DeviceMesh with named dims: ("tp",), ("dp",) or ("dp", "tp") (tp innermost).

    With no argument, the whole world is one tp group. tp is the inner dimension, so
    the ranks of a tp group are consecutive (as in Megatron-LM and torchtitan): on 4 ranks
    `make_mesh(dp=2, tp=2)` makes tp groups {0, 1} and {2, 3}.
    """
    if not dist.is_initialized():
        raise LabError("make_mesh runs on a rank: torch.distributed is not initialised here "
                       "(call it inside lab.run(...) or a %%ranks cell)")
    world = dist.get_world_size()
    if tp is None and dp is None:
        tp = world
    dims = [(name, size) for name, size in (("dp", dp), ("tp", tp)) if size is not None]
    for name, size in dims:
        if not isinstance(size, int) or size < 1:
            raise LabError(f"make_mesh: {name}={size!r} must be a positive int")
    shape = tuple(size for _, size in dims)
    names = tuple(name for name, _ in dims)
    covered = 1
    for size in shape:
        covered *= size
    if covered != world:
        asked = ", ".join(f"{n}={s}" for n, s in dims)
        hint = ""
        if world % covered == 0:
            other = "dp" if "tp" in names else "tp"
            hint = f"; for example make_mesh({asked}, {other}={world // covered})"
        raise LabError(f"make_mesh({asked}) covers {covered} ranks but the world has "
                       f"{world}: the product of the mesh sizes must equal the world "
                       f"size{hint}")
    kind = device_type()
    key = (id(dist.distributed_c10d._get_default_group()), kind, shape, names)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = init_device_mesh(kind, shape, mesh_dim_names=names)
    for name in names:
        GROUP_NAMES[mesh.get_group(name).group_name] = name
    return mesh


@dataclass(frozen=True)
class MeshShape:
    """The (dp, tp) shape of a check's mesh: made once in the notebook (`of`, which checks
    it against the world size), carried to the ranks in the check's job, made there by
    `make()`. The one place that turns a shape into a mesh (tp innermost, as make_mesh)."""

    dp: int
    tp: int

    @classmethod
    def of(cls, world: int, dp: int | None = None, tp: int | None = None,
           who: str = "grad_check") -> MeshShape:
        """(dp, tp) from what was given: neither -> (1, world); one -> the other from world;
        a LabError naming the argument when one does not divide the world or they do not
        cover it."""
        for name, size in (("dp", dp), ("tp", tp)):
            if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                     or size < 1 or world % size):
                raise LabError(f"{who}: {name}={size!r} must be a positive int that divides "
                               f"the world size {world}")
        if tp is None:
            tp = world // (dp or 1)
        dp = world // tp if dp is None else dp
        if dp * tp != world:
            raise LabError(f"{who}: dp={dp} x tp={tp} = {dp * tp} ranks, but the lab has "
                           f"{world}")
        return cls(dp, tp)

    def make(self) -> DeviceMesh:
        """This shape's mesh on the ranks: ("tp",) for dp 1, else ("dp", "tp")."""
        return make_mesh(tp=self.tp) if self.dp == 1 else make_mesh(dp=self.dp, tp=self.tp)


def forget_meshes() -> None:
    """Drop the cached meshes (their process groups are gone: the world was re-created)."""
    _MESHES.clear()
    GROUP_NAMES.clear()
    _TP_MESHES.clear()


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D tp sub-mesh of `mesh` (the mesh itself when it is already 1-D)."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    if "tp" not in names:
        raise LabError(f"a {mesh.ndim}-D mesh needs a dim named 'tp' (it has {names})")
    held = _TP_MESHES.get(id(mesh))
    if held is None or held[0] is not mesh:
        if len(_TP_MESHES) > 64:   # meshes made by hand, one after another
            _TP_MESHES.clear()
        held = _TP_MESHES[id(mesh)] = (mesh, mesh["tp"])
    return held[1]


def tp_group(mesh):
    """(process group, size, my rank in it) of the tp dim of a mesh, or of a group itself.

    On a 2-D mesh (dp, tp) this is the 1-D tp sub-mesh `mesh["tp"]`: each dp replica has its
    own tp group, and this rank talks to the one it belongs to.
    """
    if isinstance(mesh, DeviceMesh):
        sub = tp_mesh(mesh)
        return sub.get_group(), sub.size(), sub.get_local_rank()
    return mesh, dist.get_world_size(mesh), dist.get_rank(mesh)


def split(x: torch.Tensor, size: int, rank, dim: int) -> torch.Tensor:
    """This rank's chunk of `x` on `dim` (equal chunks in rank order, as `torch.chunk`);
    works in `tplab.simulate`, where `rank` holds every rank's value."""
    n = x.shape[dim] // size
    # index_select rather than narrow: in tplab.simulate `rank` holds every rank's value, and
    # an index tensor built from it carries them into the op (narrow needs one int)
    index = torch.arange(n, device=x.device) + rank * n
    return x.index_select(dim, index)
