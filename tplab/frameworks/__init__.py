"""Frameworks' own tensor-parallel code checked by tplab (both sides: adapters run on the
ranks, so they import nothing of the notebook side).

- `tplab.frameworks.from_shards(build_parallel, dims=None, layers=None)`: a plan that
  builds a framework's parallel model and loads the reference's weights into it by the
  shard metadata the framework declares (tplab/frameworks/shards.py), for any framework;
- `tplab.frameworks.megatron`: Megatron-core (needs megatron-core);
- `tplab.frameworks.fairscale`: fairscale's model-parallel layers (needs fairscale);
- `tplab.frameworks.torchtitan`: torchtitan's Llama 3 under its own sharding config
  (needs torchtitan; its own plan and context, tplab/frameworks/torchtitan.py).

Each adapter brings up the framework's parallel state on the lab's ranks and makes the
framework's own tp = 1 build the one-device reference. The adapters are submodules loaded
on first use (`from tplab.frameworks import megatron`), so that `import tplab` needs none
of the frameworks; one that is not installed is an ImportError naming the package and the
pip command. docs/FRAMEWORKS.md: versions tested, what each adapter does on CPU.
"""

from __future__ import annotations

import importlib

from tplab.frameworks.shards import FromShards, from_shards, one_rank_group

__all__ = ["ADAPTERS", "FromShards", "from_shards", "one_rank_group"]

ADAPTERS = ("megatron", "fairscale", "torchtitan")  # submodules, each imported when asked for


def __getattr__(name: str):
    """`tplab.frameworks.megatron` and the other adapters, imported on first use."""
    if name in ADAPTERS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
