"""tplab: a lab for learning tensor parallelism with PyTorch DTensor by running it.

The public API (see docs/DESIGN.md). Names are imported lazily so that `import tplab`
stays cheap on both sides: the notebook kernel and every rank process.
"""

from __future__ import annotations

import importlib
import os
import sys

from tplab.errors import CellTimeout, CollectiveHang, LabError, PlanError, RankDied, RankError

__version__ = "0.1.0"

# Public names, each from its home. Where the code lives says its side (tests/test_imports.py):
# tplab/rank/ the ranks; tplab/lab/, viz/, checks/, cost/, exercises/ and a few named top-level
# modules the notebook; the rest (tplab/core/ and the library's top-level modules) both.
_LAZY = {
    "launch": "tplab.lab.launch",
    "Lab": "tplab.lab.launch",
    "simulate": "tplab.lab.simulate",
    "Simulation": "tplab.lab.simulate",
    "LocalShard": "tplab.core.transfer",
    "grad_check": "tplab.checks.grad",
    "make_mesh": "tplab.mesh",
    "apply_plan": "tplab.plans",
    "describe_plan": "tplab.plans",
    "trace": "tplab.tracing",  # not trace.py: importing it would shadow the function
    "memory": "tplab.core.memory_use",  # not memory.py: that module would shadow the function
    "train_check": "tplab.checks.train",
    "TrainReport": "tplab.checks.train_report",
}

# Public modules: each is a real module at tplab/NAME, so `import tplab.plans`,
# `from tplab.training import steps` and `tplab.plans` (loaded on first use) all work.
# tplab/core/ holds what they are built on and is no public name.
MODULES = {name: f"tplab.{name}" for name in (
    "megatron", "models", "plans", "rng", "mesh", "hf", "parallel_styles", "plan_check",
    "tracing", "fsdp", "checkpointing", "compiling", "platforms", "training", "lessons",
    "causes", "explain", "layouts", "errors", "hf_models", "fsdp_report", "widgets", "cost",
    "viz", "exercises", "checks", "style_specs")}

__all__ = ["CellTimeout", "CollectiveHang", "LabError", "PlanError", "RankDied", "RankError",
           *_LAZY, *MODULES]


def __getattr__(name: str):
    if name in MODULES:
        return importlib.import_module(MODULES[name])
    if name not in _LAZY:
        raise AttributeError(f"module 'tplab' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def _register_magics() -> None:
    """%%ranks and %%rank exist as soon as tplab is imported in IPython (not on ranks)."""
    if "IPython" in sys.modules and not os.environ.get("TPLAB_OWNER"):
        # deferred: notebook side only; a rank's `import tplab` (its engine runs IPython too)
        # must load nothing of tplab.lab (tests/test_imports.py)
        from tplab.lab.magics import register_magics

        register_magics()


_register_magics()
