"""Megatron-core on the lab's ranks (both sides): its parallel state brought up on the lab's
mesh, its own tp = 1 build as the one-device reference, its parallel build loaded from the
reference's weights by the `partition_dim` it declares.

    from tplab.frameworks import megatron as mf
    report = tplab.grad_check(lab, mf.reference(build), mf.from_shards(build), make_input)

`build()` is the user's, unchanged: it constructs Megatron layers (or a `GPTModel`) with
`mf.config(...)`, which read the tp size from `megatron.core.parallel_state`, set here
before each build. Mirrors `parallel_state.initialize_model_parallel`,
`tensor_parallel.layers` and `tensor_parallel.random` of megatron-core 0.16.1.

CPU (docs/FRAMEWORKS.md): Megatron assumes CUDA in three places this adapter meets.
- Weights: `config()` sets `use_cpu_initialization=True` (Megatron's own CPU path: the
  master weight drawn whole, then split) and `perform_initialization=True` (only then
  does Megatron set `partition_dim` on its weights).
- RNG: `tensor_parallel.get_cuda_rng_tracker().fork()` (around attention dropout) reads
  and sets the CUDA generator's state. Without CUDA, `init` installs a tracker of the
  same class whose states are the CPU generator's: safe, the same contract on the CPU
  generator (dropout draws do not move the default stream).
- Scratch memory: `parallel_state.get_global_memory_buffer()` allocates on
  `torch.cuda.current_device()` (the attention scores' buffer). Without CUDA, `init` puts
  a buffer of the same class that allocates on the CPU in its place: safe.
- `CUDA_DEVICE_MAX_CONNECTIONS`: a warning about CUDA streams, silenced.
Not done (not safe to change from outside: `torch.cuda.current_device()` is called in the
middle of Megatron's code): RoPE (`RotaryEmbedding.get_emb` moves its frequencies to CUDA
at the first forward; on CPU use `position_embedding_type="learned_absolute"`),
sequence parallelism (its all-gather buffers are CUDA tensors), the Transformer Engine
layer specs (CUDA only: use `get_gpt_layer_local_spec()`).
Under `tplab.simulate` Megatron cannot run (`refuses_simulation` says why).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplab.frameworks.installed import require
from tplab.frameworks.shards import (
    BuiltAt,
    FromShards,
    ParallelStates,
)

parallel_state = require("megatron.core.parallel_state", "megatron-core", "0.16.1")
mp_config = require("megatron.core.model_parallel_config", "megatron-core", "0.16.1")
mp_random = require("megatron.core.tensor_parallel.random", "megatron-core", "0.16.1")
mp_utils = require("megatron.core.utils", "megatron-core", "0.16.1")

__all__ = ["SIMULATION", "config", "from_shards", "init", "reference"]

SIMULATION = (
    "Megatron-core does not run under tplab.simulate: it uses the rank as a plain int in "
    "Python (initialize_model_parallel keeps the groups `if rank in ranks`, its layers take "
    "weight_list[rank::world_size]), and a simulation runs every rank at once, where the "
    "rank is one value per rank: no tensor-parallel group is ever kept. Use ranks in "
    "processes: tplab.launch(world_size)")


class CpuRNGTracker(mp_random.CudaRNGStatesTracker):
    """Megatron's RNG-states tracker with the CPU generator's states in place of CUDA's
    (`add` seeds a named state, `fork` runs a block on it and keeps where it got to). A
    name never added forks a copy of the current CPU state, so dropout draws inside it
    leave the default stream where it was."""

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_.get(name, outside))
        try:
            yield
        finally:
            if name in self.states_:
                self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


class CpuMemoryBuffer(mp_utils.GlobalMemoryBuffer):
    """Megatron's global scratch buffer (`parallel_state.get_global_memory_buffer()`, the
    attention scores' `baddbmm` input with beta=0) allocated on the CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        size = math.prod(tensor_shape)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < size:
            held = self.buffer[(name, dtype)] = torch.empty(size, dtype=dtype)
        return held[:size].view(*tensor_shape)


def _on_cpu() -> None:
    """Megatron's RNG tracker and scratch buffer on the CPU, where there is no CUDA (module
    docstring)."""
    if torch.cuda.is_available():
        return
    if not isinstance(mp_random._CUDA_RNG_STATE_TRACKER, CpuRNGTracker):
        mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGTracker()
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


_STATES = ParallelStates(parallel_state)  # one per tp size (tplab/frameworks/shards.py)


def _bring_up(tp: int) -> None:
    parallel_state.destroy_model_parallel()
    # Megatron's extra gloo groups are for its distributed optimizer's CPU copies
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)


def init(tp: int | DeviceMesh) -> None:
    """Megatron's parallel state with tensor-parallel size `tp` (an int, or a mesh whose
    "tp" dim gives it) on this process's ranks: `initialize_model_parallel`, torch's default
    group first made with 1 rank when there is none (the notebook). Kept when it already
    has that size."""
    _STATES.init("megatron.init", tp, _bring_up,
                 parallel_state.get_tensor_model_parallel_group)
    _on_cpu()
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")


def config(kind: type | None = None, **options):
    """Megatron's `ModelParallelConfig` (or `kind`, such as `TransformerConfig`) for the
    current tp size, initialised on the CPU with Megatron's own initialisation (module
    docstring). `options` go to the config and win over these defaults."""
    options.setdefault("use_cpu_initialization", True)
    options.setdefault("perform_initialization", True)
    options.setdefault("tensor_model_parallel_size",
                       parallel_state.get_tensor_model_parallel_world_size())
    return (kind or mp_config.ModelParallelConfig)(**options)


def reference(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`build_model` for grad_check/train_check: Megatron's own model at tp = 1, its
    parallel state first set to tp = 1 (in the notebook a 1-rank group is made for it)."""
    return BuiltAt(init, build, "megatron.reference")


def from_shards(build: Callable[[], nn.Module],
                dims: dict[str, int | None] | None = None) -> FromShards:
    """The plan: `build()` at the mesh's tp size, its parameters loaded with this rank's
    piece of the reference's weights by the `partition_dim` Megatron declares
    (tplab.frameworks.shards)."""
    return FromShards(BuiltAt(init, build, "megatron.from_shards"), dims,
                      refuses_simulation=SIMULATION)
