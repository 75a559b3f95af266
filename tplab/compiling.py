"""torch.compile on a TP model (the inductor CPU backend), as a plan for grad_check,
train_check and tplab.trace.

    plan = functools.partial(tplab.compiling.compiled, plan=tplab.plans.block())

- `compiled(model, mesh, plan, backend="inductor")`: `plan` (a dict or a `(model, mesh) ->
  model` callable), then `torch.compile(model, backend=...)` of the whole model. The compiled
  model's parameters are the same objects, named with torch's `_orig_mod.` prefix
  (tplab.core.pairing reads through it).
- What it does not compose with, here: torchtitan compiles each block and puts activation
  checkpointing before compile and FSDP2 after it, but the same order with a whole-model
  compile fails in torch itself on CPU (`COMPOSITIONS`; benchmarks/compile_compositions.py
  runs it with torch's own calls): fully_shard per block after compile fails for every model
  tried; checkpoint_wrapper then compile fails for the lesson models (TinyLM) and ran for a
  norm-free MLP stack. `compiled` refuses a plan that checkpoints
  (`checkpointing.checkpointed`), and `fsdp.fsdp_tp` refuses `per_module` over a compiled
  model (`refuse_in_fully_shard`); a model of your own that runs the first composition can
  still be compiled with torch.compile directly. FSDP2 on the root of a compiled model runs.
- `why_not_inductor()`: None where inductor can compile here, else torch's reason (inductor's
  CPU backend writes C++ and builds it with the C++ compiler it finds from
  `torch._inductor.config.cpp.cxx`). `compiled` refuses with it before anything runs.
- `collectives(fn, *args)`: the collectives one call of `fn` issues, by phase and op, as
  `tplab.trace` records them: a compiled step issues the same ones as eager mode (DTensor's
  functional collectives stay ops in the compiled graph, and the trace sees them dispatched).

The first call compiles (tens of seconds per rank on a small CPU); inductor caches the code
(/tmp/torchinductor_<user>), so a later run of the same graph is quick.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import SequenceParallel

from tplab.core.compositions import (  # noqa: F401 (compiling's names: COMPOSITIONS, ...)
    COMPOSITIONS,
    is_compiled,
    refusal,
    refuse_in_fully_shard,
)
from tplab.errors import PlanError
from tplab.mesh import make_mesh
from tplab.plans import parallelizer
from tplab.tracing import trace

__all__ = ["COMPOSITIONS", "collectives", "compiled", "eager_and_compiled", "is_compiled",
           "refuse_in_fully_shard", "sequence_parallel", "why_not_inductor"]

def why_not_inductor() -> str | None:
    """torch's reason why inductor's CPU backend cannot compile here (its own search for a
    C++ compiler, `torch._inductor.cpp_builder.get_cpp_compiler`), or None."""
    # deferred: importing inductor costs about a second, and only compile needs it
    from torch._inductor import config, cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # torch's InvalidCxxCompiler (or whatever this build raises)
        return (f"torch.compile's inductor CPU backend cannot build C++ here: "
                f"{type(e).__name__}: {str(e).strip()} (searched torch._inductor.config."
                f"cpp.cxx = {config.cpp.cxx!r}); install a C++ compiler, or compile with "
                "backend='aot_eager' (no code generation)")
    return None


def sequence_parallel(plan, model: torch.nn.Module | None = None) -> bool:
    """Whether `plan` (a dict) shards activations on the sequence: a `SequenceParallel`
    style, or a style whose activation layouts hold a Shard of a non-negative dim (TP's own
    activation shards are Shard(-1)); or, for a model already planned, a tplab.megatron
    layer with `sequence_parallel` set."""
    if model is not None and any(getattr(m, "sequence_parallel", False) is True
                                 for m in model.modules()):
        return True
    if not isinstance(plan, dict):
        return False
    for style in plan.values():
        if isinstance(style, SequenceParallel):
            return True
        for name in ("input_layouts", "output_layouts", "desired_input_layouts"):
            layouts = getattr(style, name, None) or ()
            if any(isinstance(p, Shard) and p.dim >= 0 for p in layouts
                   if p is not None and not isinstance(p, tuple)):
                return True
    return False


def compiled(model: torch.nn.Module, mesh, plan=None, backend: str = "inductor"):
    """A `(model, mesh) -> model` plan: `plan`, then `torch.compile` (see the module doc).
    A sequence-parallel plan compiles too (it was refused on gloo after one lab run in 4
    "hung" in an all-gather; issue 28): no hang in 32 runs without tplab (2 processes,
    gloo, fresh inductor caches) nor in 7 lab runs, and the lab read dynamo compiling
    inside an eager all-gather frame as waiting in it (tplab/rank/whereabouts.py COMPILING)."""
    if backend == "inductor":
        why = why_not_inductor()
        if why:
            raise PlanError(why)
    if plan is not None:
        model = parallelizer(plan)(model, mesh)
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        raise PlanError(refusal("activation checkpointing"))
    return torch.compile(model, backend=backend)


def collectives(fn, *args) -> dict[str, dict[str, int]]:
    """{"forward": {op: count}, "backward": {op: count}} of one call of `fn(*args)` under
    `tplab.trace` (`fn` runs its own forward and backward)."""
    with trace() as t:
        fn(*args)
    return t.counts()


def eager_and_compiled(build_model, plan, x) -> tuple[dict, dict]:
    """Rank side, for a lesson: `collectives` of one forward and backward of the planned
    model on `x` (with its gradient), eager and then compiled (after a call that compiles)."""
    def step(model, inp):
        model(inp).pow(2).sum().backward()

    out = []
    for make in (parallelizer(plan), lambda m, mesh: compiled(m, mesh, plan)):
        model = make(build_model(), make_mesh(tp=torch.distributed.get_world_size()))
        inp = x.clone().requires_grad_()
        step(model, inp)
        out.append(collectives(step, model, inp))
    return out[0], out[1]
