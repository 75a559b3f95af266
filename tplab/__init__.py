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

_LAZY = {
    "launch": "tplab.lab.launch",
    "Lab": "tplab.lab.launch",
    "simulate": "tplab.lab.simulate",
    "Simulation": "tplab.lab.simulate",
    "LocalShard": "tplab.transfer",
    "grad_check": "tplab.check",
    "make_mesh": "tplab.mesh",
    "apply_plan": "tplab.plans",
    "describe_plan": "tplab.plans",
    "trace": "tplab.tracing",  # not trace.py: importing it would shadow the function
    "memory": "tplab.memory_use",  # not memory.py: that module would shadow the function
    "train_check": "tplab.training",
    "TrainReport": "tplab.training",
    "tracing": None,
    "megatron": None,
    "models": None,
    "plans": None,
    "hf": None,
    "parallel_styles": None,
    "plan_check": None,
    "cost": None,
    "viz": None,
    "widgets": None,
    "exercises": None,
    "platforms": None,
    "training": None,
    "fsdp": None,
    "checkpointing": None,
    "compiling": None,
}

__all__ = ["CellTimeout", "CollectiveHang", "LabError", "PlanError", "RankDied", "RankError",
           *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tplab' has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f"tplab.{name}")
    return getattr(importlib.import_module(module), name)


def _register_magics() -> None:
    """%%ranks and %%rank exist as soon as tplab is imported in IPython (not on ranks)."""
    if "IPython" in sys.modules and not os.environ.get("TPLAB_OWNER"):
        # deferred: notebook side only; a rank's `import tplab` (its engine runs IPython too)
        # must load nothing of tplab.lab (tests/test_imports.py)
        from tplab.lab.magics import register_magics

        register_magics()


_register_magics()
