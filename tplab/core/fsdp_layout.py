"""What FSDP2 did to a parameter, read on the ranks: which parameters it manages, which
are its shards of a hand-written TP piece, and a parameter's placement on the tp dim. A
leaf that the pairing (tplab.layouts) and the rank steps read; tplab.fsdp, which applies
FSDP2, builds on it and re-exports these names."""

from __future__ import annotations

import torch
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tplab.errors import PlanError

__all__ = ["SIMULATE_REASON", "managed", "over_piece", "refuse_in_simulation",
           "refuse_plan_in_simulation", "tp_view"]

SIMULATE_REASON = (
    "FSDP2 (fully_shard) does not run under tplab.simulate: after each forward FSDP2 frees "
    "its unsharded parameters with `untyped_storage().resize_(0)`, and torch's LocalTensor "
    "(one tensor holding every simulated rank's value) has no storage of its own; torch "
    f"{torch.__version__} fails there with \"RuntimeError: Attempted to call resize_() on an "
    "invalid python storage.\" Run it on rank processes: tplab.launch(4)")


def managed(model: torch.nn.Module) -> set[int]:
    """ids of the parameters FSDP2 manages: every parameter under an FSDPModule."""
    out: set[int] = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            out.update(id(p) for p in m.parameters())
    return out


def over_piece(p, declared: bool) -> bool:
    """FSDP2's sharding of a hand-written TP piece: a DTensor on a 1-D mesh that is not the
    tp dim, or one whose module declares the TP layout itself (`tp_placements`: FSDP2 was
    given the tp dim, on top of the pieces the tp ranks hold)."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim != 1:
        return False
    return declared or "tp" not in (p.device_mesh.mesh_dim_names or ())


def tp_view(value):
    """The rank's whole TP piece of a dp-sharded DTensor (all-gathered over dp)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def refuse_in_simulation(model) -> None:
    """Under tplab.simulate, a PlanError with torch's reason if FSDP2 manages any parameter
    of `model` (its first forward would fail on `resize_()`)."""
    if enabled_local_tensor_mode() is not None and managed(model):
        raise PlanError(SIMULATE_REASON)


def refuse_plan_in_simulation(plan, in_process: bool) -> None:
    """In the notebook, before anything runs: the PlanError of `refuse_in_simulation` for a
    plan that says it applies FSDP2 (`applies_fsdp2`: tplab.fsdp's plans) on a lab that runs
    in this process (tplab.simulate). The refusal holds for every rank, so it is raised
    once, here, as the message alone; a plan of your own that calls fully_shard is refused
    on the ranks (`refuse_in_simulation`). A plan whose `refuses_simulation` is a string
    (tplab.frameworks' adapters: why the framework cannot run simulated) is refused with it."""
    if in_process and getattr(plan, "applies_fsdp2", False) is True:
        raise PlanError(SIMULATE_REASON)
    reason = getattr(plan, "refuses_simulation", None)  # tplab.frameworks: a framework's why
    if in_process and isinstance(reason, str):
        raise PlanError(reason)
