"""Frameworks' own tensor-parallel code checked by tplab (both sides: adapters run on the
ranks, so they import nothing of the notebook side).

- `tplab.frameworks.from_shards(build_parallel, dims=None)`: a plan that builds a
  framework's parallel model and loads the reference's weights into it by the shard
  metadata the framework declares (tplab/frameworks/shards.py), for any framework.
- `tplab.frameworks.megatron`: Megatron-core (`import` needs megatron-core);
- `tplab.frameworks.fairscale`: fairscale's model-parallel layers (needs fairscale).

Each adapter brings up the framework's parallel state on the lab's ranks and makes its
tp = 1 build the one-device reference. docs/FRAMEWORKS.md: versions tested, what each does.
The adapters are imported by name, so that `import tplab` needs none of the frameworks.
"""

from tplab.frameworks.shards import from_shards, one_rank_group

__all__ = ["from_shards", "one_rank_group"]
