"""What a whole-model torch.compile does not compose with (tplab.compiling's table), and
the refusals that say so: a leaf both tplab.compiling and tplab.fsdp read, so that FSDP2
does not import the compile runner to refuse a compiled model."""

from __future__ import annotations

import torch

from tplab.errors import PlanError

__all__ = ["COMPOSITIONS", "is_compiled", "refusal", "refuse_in_fully_shard"]

# What a whole-model torch.compile does not compose with, and what torch itself raised
# (benchmarks/compile_compositions.py: 2 processes, gloo, CPU, mesh dp=1 x tp=2; TinyLM under
# plans.lm(loss_parallel=False) by parallelize_module, torch's checkpoint_wrapper on each
# block, fully_shard on each block and the root; inductor). Refused, not worked around.
COMPOSITIONS = {
    "activation checkpointing": (
        "TP, then activation checkpointing (checkpoint_wrapper), then torch.compile",
        "AssertionError: expected all tensors_saved_with_vc_check to be Tensors",
        "check the compiled plan without checkpointing, and checkpointing.checkpointed "
        "uncompiled (it fails for tplab's lesson models; a model of yours that runs it can "
        "call torch.compile itself: benchmarks/compile_compositions.py)"),
    "FSDP2 per module": (
        "TP, then torch.compile of the whole model, then fully_shard on its blocks "
        "(fsdp_tp's per_module)",
        "BackendCompilerFailed: AssertionError: Mixing fake modes NYI",
        "FSDP2 on the root only (fsdp_tp without per_module) runs over a compiled model; "
        "per block, check the plan uncompiled"),
}


def refusal(name: str) -> str:
    """The PlanError's words for a composition of `COMPOSITIONS` tplab refuses."""
    what, raised, instead = COMPOSITIONS[name]
    return (f"{what}: torch {torch.__version__} fails there on CPU, in plain torch too "
            f"({raised}), so tplab refuses it; {instead}")


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is torch.compile's wrapper of a module (its `_orig_mod`)."""
    return isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)


def refuse_in_fully_shard(model: torch.nn.Module, per_module) -> None:
    """For tplab.fsdp: a PlanError when FSDP2 would shard blocks inside a compiled model."""
    if per_module and is_compiled(model):
        raise PlanError(refusal("FSDP2 per module"))
