"""torchtitan's Llama 3 under its own tensor parallelism, checked by tplab (both sides: the
plan and the context run on the ranks; needs torchtitan 0.3.0, see docs/FRAMEWORKS.md).

    from tplab.frameworks import torchtitan as titan
    config = titan.debug_config()                       # torchtitan's llama3, 2 small layers
    report = tplab.grad_check(lab, **titan.grad_check_args(config))          # its own TP
    report = tplab.grad_check(lab, **titan.grad_check_args(config, fsdp=True), dp=2)

What it does, in torchtitan's own terms (torchtitan/trainer.py is the model):
- `debug_config` builds a `Llama3Model.Config` the way torchtitan's `debugmodel` flavor
  does (models/llama3/__init__.py), smaller, with SDPA attention (FlexAttention has no CPU
  backward), and declares its sharding with `set_llama3_sharding_config` (the
  `ShardingConfig` of every module: state shardings, input and output layouts). Plant a
  bug by editing that declaration before the check.
- `plan()` is a plan `(model, mesh) -> model` that brings up `ParallelDims` (dp_shard =
  the check's dp, tp = its tp) on the lab's ranks, checks that its tp coordinates are the
  lab mesh's, and parallelises the model with `Module.parallelize` on torchtitan's default
  spmd_types backend (TP), or with `parallelize_llama` as its trainer does (`plan(fsdp=
  True)`: FSDP2 + TP, gradients summed over dp). FSDP2 runs on torchtitan's
  partial_dtensor backend: on spmd_types its `fully_shard(..., dp_mesh_dims=...)` needs a
  torch whose FSDP2 reads spmd_types annotations, and torch 2.13.0 refuses ("When
  dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh").
  Every parameter's TP layout is read from its module's `state_shardings` and declared
  as `tp_placements` (what tplab's checks read), so the spmd_types backend's plain local
  shards are assembled by torchtitan's own declaration.
- `context()` is torchtitan's training context (`get_spmd_context`): its default SPMD
  backend reads the current mesh from it, and without it every redistribution is skipped.
- `Loss` is torchtitan's `cross_entropy_loss` (vocab-parallel on the ranks) summed and
  divided by the global token count, its convention; hence `dp_reduction="sum"`.
- The one-device reference is the same config built at tp = 1 from the same weights.

CPU: torchtitan picks its device type at import ("cuda" when no accelerator is found);
`plan` points ParallelDims at "cpu" when torch has no CUDA (torchtitan's own meshes, not
the lab's). Everything else runs as torchtitan runs it. Under tplab.simulate it cannot
run (`SIMULATE_REASON`): the plan says so before the model runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import Replicate, Shard

from tplab.errors import PlanError

INSTALL = ("pip install -c scripts/constraints.txt spmd_types==0.2.3 tyro==1.0.17 "
           "triton==3.9.0\n    pip install --no-deps -c scripts/constraints.txt "
           "torchtitan==0.3.0")
try:
    import spmd_types as spmd
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as titan_dims
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        ScaledDotProductAttention,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, parallelize_llama
    from torchtitan.models.llama3.model import Llama3TransformerBlock
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.protocols.module import Module as TitanModule
except ImportError as e:  # torchtitan is optional: tplab runs without it
    raise ImportError(f"tplab.frameworks.torchtitan needs torchtitan 0.3.0 and its "
                      f"dependencies ({e}). Install them with\n    {INSTALL}\n(--no-deps: "
                      "torchtitan's other requirements are for its data loaders and "
                      "loggers; torch stays the one you have)") from e

__all__ = ["Loss", "build", "context", "debug_config", "grad_check_args", "make_tokens",
           "Plan", "plan", "tp_layouts", "tp_type", "train_check_args"]

_LOCAL = threading.local()  # the ParallelDims `plan` brought up on this rank


def _inits(std: float) -> tuple[dict, dict, dict]:
    """(linear, norm, embedding) initialisers, as torchtitan's llama3 flavors give them."""
    linear = {"weight": functools.partial(nn.init.trunc_normal_, std=std),
              "bias": nn.init.zeros_}
    return linear, {"weight": nn.init.ones_}, {"weight": functools.partial(nn.init.normal_,
                                                                           std=1.0)}


def debug_config(*, layers: int = 2, dim: int = 64, n_heads: int = 8, n_kv_heads: int = 4,
                 vocab_size: int = 256, enable_sp: bool = False):
    """torchtitan's llama3 `debugmodel` (models/llama3/__init__.py), smaller: `layers`
    blocks of width `dim`, grouped-query attention, SDPA (CPU has no FlexAttention
    backward), its sharding declared by `set_llama3_sharding_config`."""
    linear, norm, embedding = _inits(0.02)
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=1024, theta=500000,
                              scaling="llama")
    blocks = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  wqkv_param_init=linear, wo_param_init=linear,
                                  inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=rope),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=compute_ffn_hidden_dim(
            dim, multiple_of=32), w1_param_init=linear, w2w3_param_init=linear))
        for _ in range(layers)]
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=embedding),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size,
                              param_init=_inits(dim ** -0.5)[0]),
        layers=blocks)
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return config


def _build(config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def build(config, seed: int = 0) -> Callable[[], nn.Module]:
    """`build_model` for grad_check: the whole model (tp = 1), seeded."""
    return functools.partial(_build, config, seed)


def _tokens(vocab_size: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def make_tokens(config, batch: int = 2, seq: int = 16, seed: int = 0) -> Callable:
    """`make_input`: a (batch, seq) batch of token ids (the labels are the next tokens)."""
    return functools.partial(_tokens, config.vocab_size, batch, seq, seed)


@dataclasses.dataclass(frozen=True)
class Loss:
    """torchtitan's loss (components/loss.py): `cross_entropy_loss` summed over tokens
    (vocab-parallel on local logits inside the context), divided by the global token count
    `tokens` (the whole batch's: so the replicas' losses are summed over dp)."""

    vocab_size: int
    tokens: int

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        labels = torch.roll(tokens, -1, dims=1)
        return cross_entropy_loss(logits, labels, global_vocab_size=self.vocab_size) / self.tokens


def _parallel_dims(mesh, backend: str) -> titan_dims.ParallelDims:
    """torchtitan's ParallelDims for the lab's (dp, tp) mesh, on CPU where torch has no
    CUDA (torchtitan reads its device type once, at import)."""
    names = mesh.mesh_dim_names or ()
    tp = mesh["tp"].size() if "tp" in names else mesh.size()
    dp = mesh["dp"].size() if "dp" in names else 1
    if not torch.cuda.is_available():
        titan_dims.device_type = "cpu"
    dims = titan_dims.ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1,
                                   world_size=dp * tp, spmd_backend=backend)
    ours = dims.get_dense_tp_mesh() if tp > 1 else None
    lab_tp = mesh["tp"] if "tp" in names else mesh
    if ours is not None and ours.get_local_rank() != lab_tp.get_local_rank():
        raise PlanError("tplab.frameworks.torchtitan: torchtitan's tp coordinate differs "
                        "from the lab mesh's (torchtitan puts tp innermost)")
    return dims


SIMULATE_REASON = (
    "torchtitan's model does not run under tplab.simulate: its vocab-parallel Embedding "
    "computes its vocab offset from `dist.get_rank(tp_group)` as a Python int, which torch's "
    "LocalTensor (one tensor holding every simulated rank's value) makes a LocalIntNode, and "
    f"torch {torch.__version__} fails on it (\"AttributeError: 'LocalIntNode' object has no "
    "attribute 'guard_int'\"). Run it on rank processes: tplab.launch(2)")


class Plan:
    """The plan `(model, mesh) -> model`: torchtitan's own TP (`Module.parallelize`, its
    default spmd_types backend), or FSDP2 + TP as its trainer applies them
    (`parallelize_llama`, on the partial_dtensor backend: torch 2.13's fully_shard takes
    DTensor parameters only) with `fsdp=True`. `applies_fsdp2` and `refuses_simulation`
    say, before anything runs, why it cannot run under tplab.simulate."""

    refuses_simulation = SIMULATE_REASON

    def __init__(self, fsdp: bool = False):
        if not isinstance(fsdp, bool):
            raise PlanError(f"tplab.frameworks.torchtitan.plan: fsdp must be True or False, "
                            f"got {fsdp!r}")
        self.fsdp = self.applies_fsdp2 = fsdp

    def __call__(self, model: nn.Module, mesh) -> nn.Module:
        if enabled_local_tensor_mode() is not None:
            raise PlanError(SIMULATE_REASON)
        backend = "partial_dtensor" if self.fsdp else "spmd_types"
        titan_utils.set_spmd_backend(backend)
        dims = _LOCAL.dims = _parallel_dims(mesh, backend)
        if self.fsdp:
            model = parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(
                mixed_precision_param="float32", mixed_precision_reduce="float32"),
                parallelism=ParallelismConfig(spmd_backend=backend),
                compile_config=CompileConfig(), ac_config=None, dump_folder="")
            disable_fsdp_gradient_division(model)  # as its trainer: the loss divides
        elif dims.tp > 1:
            model.parallelize(dims)
        declare_tp_placements(model)
        return model


def plan(fsdp: bool = False) -> Plan:
    """torchtitan's TP (or FSDP2 + TP with `fsdp=True`) as a grad_check plan."""
    return Plan(fsdp)


def tp_layouts(model: nn.Module) -> dict[str, object]:
    """{parameter name: its placement on the tp axis}, read from each torchtitan module's
    `ShardingConfig.state_shardings` (S(d) -> Shard(d); R, I -> Replicate)."""
    out = {}
    for path, module in model.named_modules():
        config = getattr(module, "_sharding_config", None)  # torchtitan has no public getter
        if not isinstance(module, TitanModule) or config is None:
            continue
        for name, _ in module.named_parameters(recurse=False):
            layout = config.state_shardings.get(name)
            if layout is not None:
                out[f"{path}.{name}" if path else name] = _tp_placement(layout)
    return out


def tp_type(layout) -> str:
    """The spmd type a torchtitan `SpmdLayout` gives the tp axis: "I" (invariant: the same
    value, its gradient too), "R" (replicated: its gradient a partial sum), "P" (partial
    sums), "S(d)" (sharded on dim d)."""
    return repr(layout.per_axis_spmd_types().get(titan_dims.MeshAxisName.TP, spmd.R))


def _tp_placement(layout):
    kind = layout.per_axis_spmd_types().get(titan_dims.MeshAxisName.TP, spmd.R)
    return Shard(kind.dim) if isinstance(kind, spmd.Shard) else Replicate()


def declare_tp_placements(model: nn.Module) -> None:
    """Declare each plain parameter's tp placement on its module (`tp_placements`, what
    tplab.layouts reads): the spmd_types backend keeps local shards as plain tensors."""
    layouts = tp_layouts(model)
    for path, module in model.named_modules():
        mine = {n: layouts[f"{path}.{n}" if path else n]
                for n, p in module.named_parameters(recurse=False)
                if (f"{path}.{n}" if path else n) in layouts
                and not hasattr(p, "device_mesh")}
        if mine:
            module.tp_placements = mine


@contextlib.contextmanager
def context():
    """torchtitan's training context on this rank (`get_spmd_context` with the
    ParallelDims `plan` brought up): forward and the loss run inside it."""
    dims = getattr(_LOCAL, "dims", None)
    if dims is None:
        raise PlanError("tplab.frameworks.torchtitan.context: no ParallelDims on this rank; "
                        "use it with tplab.frameworks.torchtitan.plan()")
    with titan_utils.get_spmd_context(parallel_dims=dims)():
        yield


def _output_dim(config) -> int | None:
    """The logits' tp layout as the lm head declares it (out_dst, else out_src)."""
    sharding = config.lm_head.sharding_config
    layout = sharding.out_dst_shardings or sharding.out_src_shardings
    placement = _tp_placement(layout) if layout is not None else Replicate()
    return placement.dim if isinstance(placement, Shard) else None


def grad_check_args(config, *, fsdp: bool = False, batch: int = 2, seq: int = 16,
                    seed: int = 0) -> dict:
    """grad_check's arguments for torchtitan's model under its own parallelism."""
    return {"build_model": build(config, seed), "plan": plan(fsdp),
            "make_input": make_tokens(config, batch, seq, seed),
            "loss_fn": Loss(config.vocab_size, batch * seq), "context": context,
            "outputs": {"output": _output_dim(config)}, "dp_reduction": "sum"}


def train_check_args(config, *, fsdp: bool = False, batch: int = 2, seq: int = 16,
                     seed: int = 0) -> dict:
    """train_check's arguments (step i's batch drawn with seed + i)."""
    args = grad_check_args(config, fsdp=fsdp, batch=batch, seq=seq, seed=seed)
    del args["make_input"], args["outputs"]
    args["make_batch"] = functools.partial(_batch, config.vocab_size, batch, seq, seed)
    return args


def _batch(vocab_size: int, batch: int, seq: int, seed: int, i: int) -> torch.Tensor:
    return _tokens(vocab_size, batch, seq, seed + i)
