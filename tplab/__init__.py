"""tplab: a lab for learning tensor parallelism with PyTorch DTensor by running it.

The public API (see docs/DESIGN.md). Names are imported lazily so that `import tplab`
stays cheap on both sides: the notebook kernel and every rank process.
"""

from __future__ import annotations

import importlib
import os
import sys

from tplab.core.errors import CellTimeout, CollectiveHang, LabError, PlanError, RankDied, RankError

__version__ = "0.1.0"

# Public names, each from its home. Where the code lives says its side: tplab/core/ (both
# sides), tplab/rank/ (the ranks), everything else the notebook (tests/test_imports.py).
_LAZY = {
    "launch": "tplab.lab.launch",
    "Lab": "tplab.lab.launch",
    "simulate": "tplab.lab.simulate",
    "Simulation": "tplab.lab.simulate",
    "LocalShard": "tplab.core.transfer",
    "grad_check": "tplab.checks.grad",
    "make_mesh": "tplab.core.mesh",
    "apply_plan": "tplab.core.plans",
    "describe_plan": "tplab.core.plans",
    "trace": "tplab.core.tracing",  # not trace.py: importing it would shadow the function
    "memory": "tplab.core.memory_use",  # not memory.py: that module would shadow the function
    "train_check": "tplab.checks.train",
    "TrainReport": "tplab.checks.train_report",
}

# Public modules by their short names: `tplab.plans.block()`, `from tplab import models`.
# (`from tplab.X import name` needs the home: `from tplab.core.models import Config`.)
MODULES = {
    **{name: f"tplab.core.{name}" for name in (
        "megatron", "models", "plans", "rng", "mesh", "hf", "parallel_styles", "plan_check",
        "tracing", "fsdp", "checkpointing", "compiling", "platforms", "training", "lessons",
        "causes", "explain", "layouts", "errors")},
    **{name: f"tplab.checks.{name}" for name in ("hf_models", "fsdp_report")},
    "widgets": "tplab.viz.widgets",
    "cost": "tplab.cost",
    "viz": "tplab.viz",
    "exercises": "tplab.exercises",
    "checks": "tplab.checks",
    "core": "tplab.core",
}

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
