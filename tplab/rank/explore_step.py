"""Rank side of the Explorer (tplab/checks/explorer.py): the one TP step each control change runs.

`explore_step` builds the chosen model with the notebook's weights, parallelises it by the
hand-written Megatron path or a DTensor plan, runs forward and backward under
`tplab.trace()`, and returns the output, the gradients, each parameter's shards (as
DTensors on the whole mesh) and the trace records. `Settings` is what the controls say: the
notebook makes it, the ranks read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from tplab import megatron, models, plans
from tplab.core import placements
from tplab.layouts import tp_layout
from tplab.mesh import make_mesh, tp_mesh
from tplab.plans import apply_plan
from tplab.tracing import Trace

__all__ = ["MODELS", "PATHS", "ExploreResult", "Settings", "build_model", "explore_step"]

MODELS = ("mlp", "attention", "block")
PATHS = ("megatron", "dtensor")


@dataclass(frozen=True)
class Settings:
    """What the controls say."""

    model: str = "mlp"
    tp: int = 0  # 0 (or None): the lab's world size
    path: str = "megatron"
    sequence_parallel: bool = False
    drop_f: bool = False


@dataclass(frozen=True, eq=False)
class ExploreResult:
    """What one rank's `explore_step` hands the Explorer (by pickle): the output, the loss
    (shape (1,)), the input's gradient, each parameter's gradient and value as DTensors on
    the whole mesh (LocalShards in the notebook), and the rank's trace records (dicts)."""

    output: torch.Tensor
    loss: torch.Tensor
    input_grad: torch.Tensor | None
    grads: dict
    params: dict
    records: list[dict]


def build_model(kind: str, cfg):
    """The model the Explorer's "model" control names, built whole from `cfg`."""
    return {"mlp": models.MLP, "attention": models.Attention, "block": models.Block}[kind](cfg)


def _dtensor_plan(kind: str, sequence_parallel: bool) -> dict:
    """`tplab.plans`' plan for the model (a lone MLP or attention under SP shards the
    sequence at its input and gathers it at its output, as `plans.block` does)."""
    return {"mlp": plans.mlp, "attention": plans.attention,
            "block": plans.block}[kind](sequence_parallel)


def _as_dtensor(t, mesh, placement):
    """A parameter or gradient as a DTensor on the whole mesh (Replicate over dp)."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        placement, t = t.placements[-1], t.to_local()
    lead = [Replicate()] * (mesh.ndim - 1)
    return DTensor.from_local(t.detach(), mesh, [*lead, placement], run_check=False)


def explore_step(kind: str, cfg, state: dict, x: torch.Tensor, s: Settings) -> ExploreResult:
    """One traced forward and backward of the chosen model, path and settings."""
    world = dist.get_world_size()
    mesh = make_mesh(tp=s.tp) if s.tp == world else make_mesh(dp=world // s.tp, tp=s.tp)
    model = build_model(kind, cfg)
    model.load_state_dict(state)
    if s.path == "megatron":
        # the 1-D tp sub-mesh: tplab.megatron's layers talk on its only dimension
        model = megatron.parallelize(model, tp_mesh(mesh), sequence_parallel=s.sequence_parallel,
                                     reduce_grad=not s.drop_f)
    else:
        model = apply_plan(model, mesh, _dtensor_plan(kind, s.sequence_parallel))
    x = x.clone().requires_grad_(True)
    with Trace() as t:
        out = model(x)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        loss = 0.5 * out.pow(2).sum()
        loss.backward()
    params = {name: _as_dtensor(info.value, mesh, placements.placement(info.placement))
              for name, info in tp_layout(model, of="param").items()}
    grads = {name: _as_dtensor(info.value, mesh, placements.placement(info.placement))
             for name, info in tp_layout(model).items()}
    # the loss as shape (1,): a 0-d tensor comes back from rank processes as (1,) anyway
    return ExploreResult(out.detach(), loss.detach().reshape(1), x.grad, grads, params,
                         t.records)
