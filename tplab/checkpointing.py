"""Activation checkpointing under TP, with tplab.rng's dropout masks kept through the
recomputation (what Megatron-LM's `CheckpointFunction` does for its RNG tracker).

`torch.utils.checkpoint` recomputes a block's forward during backward. With
`preserve_rng_state=True` (its default) it restores torch's DEFAULT generator before the
recomputation, but tplab.rng's dropout draws from its tracker's own generators
(`rng.RNGTracker`: one "replicated" stream, one "tp" stream per rank). Those have moved on by
then, so a plain checkpoint redraws OTHER masks in the recomputation: the backward pass
differentiates another network than the forward ran, and nothing fails.

- `keep_masks(module)`: a `context_fn` for `torch.utils.checkpoint.checkpoint(...,
  use_reentrant=False, context_fn=...)` and `checkpoint_wrapper(..., context_fn=...)`: the
  forward saves every tracker's state as it starts; the recomputation starts from that state
  and hands the trackers back as it found them.
- `checkpoint_blocks(model, per_module=("Block",), masks="keep")`: wrap every submodule of
  those class names (or module names) in `checkpoint_wrapper` (non-reentrant);
  `masks="redraw"` is the bug: torch's checkpoint alone.
- `checkpointed(model, mesh, plan, per_module, masks)`: a `(model, mesh) -> model` plan:
  `plan` (a dict or a callable, such as `rng.parallelize`'s partial), then
  `checkpoint_blocks` (torchtitan's order: TP, then activation checkpointing, then FSDP2).
- `memory_of(build_model, plan, x, per_module)`: rank side, for a lesson: `tplab.memory`'s
  numbers for one forward and backward of the planned model on `x`, plain and with
  `per_module` checkpointed (rows by module path, the wrapper's name left out).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from tplab import models
from tplab.core.memory_use import memory
from tplab.errors import PlanError
from tplab.mesh import make_mesh
from tplab.plans import parallelizer
from tplab.rng import Dropout

__all__ = ["checkpoint_blocks", "checkpointed", "keep_masks", "memory_of", "trackers"]


def trackers(module: torch.nn.Module) -> list:
    """The distinct RNG trackers of every tplab.rng Dropout in `module`."""
    seen: dict[int, object] = {}
    for m in module.modules():
        if isinstance(m, Dropout):
            seen.setdefault(id(m.tracker), m.tracker)
    return list(seen.values())


def _generators(tracker) -> list[torch.Generator]:
    return [tracker.replicated, *tracker.tp]


def keep_masks(module: torch.nn.Module):
    """A checkpoint `context_fn` that keeps `module`'s tplab.rng masks through the
    recomputation (see the module docstring)."""
    gens = [g for t in trackers(module) for g in _generators(t)]

    def context_fn():
        saved: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward():
            saved[:] = [g.get_state() for g in gens]
            yield

        @contextlib.contextmanager
        def recompute():
            now = [g.get_state() for g in gens]
            for g, state in zip(gens, saved, strict=True):
                g.set_state(state)
            try:
                yield
            finally:
                for g, state in zip(gens, now, strict=True):
                    g.set_state(state)

        return forward(), recompute()

    return context_fn


def checkpoint_blocks(model: torch.nn.Module, per_module=("Block",),
                      masks: str = "keep",
                      impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT) -> torch.nn.Module:
    """Wrap each submodule whose class name (a subclass's too) or module name is in
    `per_module` in a `checkpoint_wrapper` (non-reentrant unless `impl` says
    `CheckpointImpl.REENTRANT`); `masks="redraw"` plants the bug of not restoring
    tplab.rng's streams. Returns the model."""
    if masks not in ("keep", "redraw"):
        raise PlanError(f"checkpoint_blocks: masks is 'keep' or 'redraw' (the bug), not "
                        f"{masks!r}")
    if not isinstance(impl, CheckpointImpl):
        raise PlanError(f"checkpoint_blocks: impl is a CheckpointImpl, not {impl!r}")
    wanted = set(per_module)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kinds = {c.__name__ for c in type(child).__mro__}
            if not (kinds & wanted or name in wanted):
                continue
            kw = {"context_fn": keep_masks(child)} if masks == "keep" and trackers(child) else {}
            if kw and impl is CheckpointImpl.REENTRANT:
                raise PlanError(f"checkpoint_blocks: {name} draws tplab.rng dropout masks, "
                                "and torch's reentrant checkpoint takes no context_fn to keep "
                                "them: use CheckpointImpl.NO_REENTRANT")
            setattr(parent, name, checkpoint_wrapper(child, checkpoint_impl=impl, **kw))
            found += 1
    if not found:
        raise PlanError(f"checkpoint_blocks: no submodule of {type(model).__name__} is a "
                        f"{' or '.join(sorted(wanted))}")
    return model


def checkpointed(model: torch.nn.Module, mesh, plan=None, per_module=("Block",),
                 masks: str = "keep") -> torch.nn.Module:
    """A `(model, mesh) -> model` plan: `plan`, then `checkpoint_blocks`."""
    if plan is not None:
        model = parallelizer(plan)(model, mesh)
    return checkpoint_blocks(model, per_module, masks)


def memory_of(build_model, plan, x, per_module=("Block",)) -> dict[str, dict]:
    """Rank side: {"plain": ..., "checkpointed": ...}, each tplab.memory's activation_bytes,
    recomputed_bytes, peak_bytes and rows ({module: bytes}) of one forward and backward of
    `build_model()` under `plan` (on a tp mesh of the whole world), the loss `.sum()` of
    its output (tokens in, logits out: tplab.models.lm_loss when `x` holds integers)."""
    out = {}
    for name in ("plain", "checkpointed"):
        model = build_model()
        model = parallelizer(plan)(model, make_mesh())
        if name == "checkpointed":
            checkpoint_blocks(model, per_module)
        with memory() as m:
            y = model(x)
            (models.lm_loss(y, x) if not x.is_floating_point() else y.sum()).backward()
        out[name] = {k: getattr(m, k) for k in ("activation_bytes", "recomputed_bytes",
                                                "peak_bytes")}
        for key in ("rows", "recomputed_rows"):
            out[name][key] = {r["module"].replace("._checkpoint_wrapped_module", "")
                              .replace("_checkpoint_wrapped_module.", ""): r["bytes"]
                              for r in getattr(m, key)}
    return out
