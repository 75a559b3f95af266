"""ParallelStyles torch does not ship, for the layouts today's models publish.

transformers 5.x plans Qwen3, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek and the rest with some
styles that have no torch DTensor equivalent (transformers/distributed/tensor_parallel.py).
Each is a small `torch.distributed.tensor.parallel.ParallelStyle` here (one method,
`_apply(module, mesh)`, as torch's own), built from the same two conjugate operators the
lessons teach (Shoeybi et al. 2019, section 3), as Functions that carry their reason
(`ctx.tp_cause`): f (identity forward, all-reduce backward) and g (all-reduce forward,
identity backward).

- `ReplicatedGradAllReduce`: a replicated weight applied to head-sharded activations
  (Qwen3's q_norm/k_norm): each rank's gradient covers its own heads only, so it is summed
  over the tp group after backward. This is f in its weight form.
- `PackedColwise` / `PackedRowwise`: a weight that stacks sub-matrices (gate and up, or q, k
  and v) split so that each rank holds its slice of EVERY sub-matrix (torch's
  `_StridedShard`), where a plain `Shard(0)` would give rank 0 all of gate, rank 1 all of up.
- `MoEExperts`: every rank runs its slice of every expert; f on the tokens and routing
  weights, g on the summed output.
- `ShardParameters` (bare parameters, such as stacked expert weights), `LocalParams`
  (forward on the local shards), `AllReduceOutput` (g), `MlaKvAProj` (f on the RoPE part of
  DeepSeek's MLA projection), `ScaleInput` (an identity expert inside a summed MoE), and
  `Styles` (several styles on one module, in order).

Each style's collectives carry a `tp_cause` that `tplab.trace` shows as the record's cause.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


def packed_placement(dim: int, split_factor: int) -> Placement:
    """Each rank's slice of each of `split_factor` sub-matrices stacked on `dim`
    (`_StridedShard`: DTensor's name for "split each of the k blocks, not the whole")."""
    return _StridedShard(dim=dim, split_factor=split_factor)


def _group(mesh):
    return mesh.get_group()


class TplabStyle(ParallelStyle):
    """The base of these styles: a ParallelStyle that prints its arguments (torch's styles
    print their layouts)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                         if not k.startswith("_") and k != "src_data_rank")
        return f"{type(self).__name__}({args})"


class ShardParameters(TplabStyle):
    """Distribute a module's own parameters with the given placements, {name: Placement};
    its forward is left alone (pair it with `LocalParams` or `MoEExperts`). For bare
    parameters that torch's styles cannot reach: MoE experts' stacked 3-D weights,
    attention sinks. Each rank cuts its piece from its own full copy when
    `src_data_rank` is None, else rank `src_data_rank`'s copy is scattered (torch's rule)."""

    def __init__(self, placements: dict[str, Placement]):
        super().__init__()
        if not isinstance(placements, dict) or not all(
                isinstance(p, Placement) for p in placements.values()):
            raise TypeError("placements: a dict {parameter name: Placement}")
        self.placements = dict(placements)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, placement in self.placements.items():
            p = module._parameters.get(name)
            if p is None:
                raise ValueError(f"{type(module).__name__} has no parameter {name!r}; its "
                                 f"parameters: {', '.join(module._parameters) or 'none'}")
            if isinstance(placement, Shard) and placement.dim < 0:
                placement = Shard(placement.dim + p.ndim)
            whole = p.detach().clone()
            if self.src_data_rank is not None:  # rank src's copy is the truth: send it
                dist.broadcast(whole, group_src=self.src_data_rank,
                               group=device_mesh.get_group())
            # each rank then cuts its own piece (DTensor's scatter of a _StridedShard gives
            # every rank the first piece under tplab.simulate, torch 2.13)
            dt = distribute_tensor(whole, device_mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        return module


class LocalParams(TplabStyle):
    """Run the module's forward on its DTensor parameters' local shards (plain tensors);
    their gradients flow back into the DTensors (`to_local`'s backward). transformers'
    `local_params`; used for modules whose forward does its own local math."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        stash: dict[str, nn.Parameter] = {}

        def pre(mod, args):
            for name, p in list(mod._parameters.items()):
                if isinstance(p, DTensor):
                    stash[name] = p
                    mod._parameters[name] = p.to_local()

        def post(mod, args, output):
            mod._parameters.update(stash)
            stash.clear()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post, always_call=True)
        return module


# the trace's cause of its gradient all-reduce (tplab.causes shows it for transformers' own too)
REPLICATED_GRAD_RULE = ("replicated weight applied to head-sharded activations: each rank "
                        "holds a partial gradient; summed over the TP group")


class ReplicatedGradAllReduce(TplabStyle):
    """A replicated parameter whose gradient is partial: the module (Qwen3's per-head
    q_norm/k_norm) sits between a colwise and a rowwise layer and sees only this rank's
    heads, so dL/dw = sum over ranks of each rank's heads' term. No forward collective; the
    gradient is all-reduced over the tp group once accumulated (f's rule, for a weight).
    transformers' `replicated_with_grad_allreduce`."""

    tp_cause = f"replicated_with_grad_allreduce: {REPLICATED_GRAD_RULE}"

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._mesh = device_mesh
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._sum_partial_grad)
        return module

    def _sum_partial_grad(self, param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=_group(self._mesh))


class _ExplainedCopy(torch.autograd.Function):
    """f with the style's reason attached (`ctx.tp_cause`, shown by tplab.trace): identity
    forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group, cause):
        ctx.group, ctx.tp_cause = group, cause
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _ExplainedReduce(torch.autograd.Function):
    """g with the style's reason attached: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, cause):
        ctx.tp_cause = cause
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def packed_rows(rows: int, split_factor: int, tp: int) -> str:
    """Which rows of a packed weight each rank holds, in words."""
    n = rows // split_factor
    return (f"rank r holds rows r*{n // tp}:(r+1)*{n // tp} of each of the {split_factor} "
            f"packed sub-matrices ({n} rows each)")


class PackedColwise(TplabStyle):
    """Column-parallel for an nn.Linear whose weight stacks `split_factor` sub-matrices on
    its output dim (Phi-3's gate_up_proj, a fused qkv): rank r holds rows r*n/tp..(r+1)*n/tp
    of EACH sub-matrix of n rows (`_StridedShard(0, split_factor)`), so its local output is
    [gate_r, up_r] and the model's own `chunk(2, -1)` still pairs gate with up. The input
    is replicated (f: its gradient all-reduced); the forward runs on the local shards and
    the output stays local. transformers' `packed_colwise`."""

    def __init__(self, split_factor: int = 2):
        super().__init__()
        if not isinstance(split_factor, int) or split_factor < 1:
            raise ValueError(f"split_factor must be a positive int, got {split_factor!r}")
        self.split_factor = split_factor

    def cause(self, rows: int, tp: int) -> str:
        return (f"packed_colwise f: {packed_rows(rows, self.split_factor, tp)}; the "
                "replicated input's gradient is the sum of the ranks' terms")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"PackedColwise splits an nn.Linear, got {type(module).__name__}")
        tp = device_mesh.size()
        rows = module.out_features
        if rows % (self.split_factor * tp):
            raise ValueError(f"{type(module).__name__}: out_features = {rows} is not "
                             f"{self.split_factor} packed blocks divisible by tp = {tp}")
        placements = {name: packed_placement(0, self.split_factor)
                      for name, _ in module.named_parameters(recurse=False)}
        ShardParameters(placements)._apply(module, device_mesh)
        group, cause = _group(device_mesh), self.cause(rows, tp)

        def pre(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(placements=[Replicate()]).to_local()
            return (_ExplainedCopy.apply(x, group, cause), *args[1:])

        module.register_forward_pre_hook(pre)
        LocalParams()._apply(module, device_mesh)
        return module


class PackedRowwise(ShardParameters):
    """The weights of a packed layer laid out (.., in, packed out), as Llama 4's experts:
    each rank's slice of every sub-matrix on the last dim (`_StridedShard(-1, k)`); biases
    replicated. Parameters only, as transformers' `packed_rowwise`."""

    def __init__(self, names: dict[str, int], split_factor: int = 2):
        super().__init__({name: Replicate() if ndim == 1 else
                          packed_placement(ndim - 1, split_factor)
                          for name, ndim in names.items()})


class MoEExperts(TplabStyle):
    """Tensor-parallel MoE experts: every rank holds a slice of EVERY expert (gate_up
    packed colwise, down rowwise), so every rank runs every routed token through its slices:
    f on the tokens and on the routing weights (their gradients are partial), the forward on
    the local shards, g on the output (each rank's sum over experts is a partial sum of the
    hidden dim's terms). Parameters may be sharded by `ShardParameters` first (see
    `Styles`). transformers' `moe_tp_experts`."""

    def causes(self, module: nn.Module, tp: int) -> tuple[str, str]:
        """(f's reason, g's reason) for `module`'s experts at tp ranks."""
        packed = getattr(module, "gate_up_proj", None)
        held = ""
        if isinstance(packed, torch.Tensor) and packed.ndim == 3:
            held = f" ({packed_rows(packed.shape[1], 2, tp)} of gate_up, for every expert)"
        return (f"moe_tp_experts f: every rank runs every routed token through its slice of "
                f"every expert{held}, so the tokens' and routing weights' gradients are "
                "partial: summed over the TP group",
                "moe_tp_experts g: each rank's expert output is a partial sum over its slice "
                "of the experts' hidden dim: summed over the TP group")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = _group(device_mesh)
        f_cause, g_cause = self.causes(module, device_mesh.size())

        def pre(mod, args, kwargs):
            hidden, *rest = args
            if isinstance(hidden, DTensor):
                hidden = hidden.to_local()
            hidden = _ExplainedCopy.apply(hidden, group, f_cause)
            if len(rest) >= 2 and rest[1].requires_grad:  # top_k_index, top_k_weights
                rest[1] = _ExplainedCopy.apply(rest[1], group, f_cause)
            elif "top_k_weights" in kwargs:
                kwargs = {**kwargs, "top_k_weights": _ExplainedCopy.apply(kwargs["top_k_weights"],
                                                                     group, f_cause)}
            return (hidden, *rest), kwargs

        def post(mod, args, output):
            return None if output is None else _ExplainedReduce.apply(output, group, g_cause)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        LocalParams()._apply(module, device_mesh)
        module.register_forward_hook(post)
        return module


class AllReduceOutput(TplabStyle):
    """g on the module's output: each rank's output is a partial sum (a shared expert fed
    by sharded columns), summed over the tp group. transformers' `all_reduce`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = _group(device_mesh)

        def post(mod, args, output):
            if isinstance(output, DTensor):
                output = output.to_local()
            return None if output is None else _ExplainedReduce.apply(
                output, group, "all_reduce g: each rank's output is a partial sum (fed by "
                               "its shard of the columns): summed over the TP group")

        module.register_forward_hook(post)
        return module


class MlaKvAProj(TplabStyle):
    """DeepSeek's MLA: kv_a_proj's output is [k_pass, k_rope]; k_pass goes through the
    column-parallel kv_b_proj (whose f sums its gradient), but k_rope goes straight to
    every rank's heads, so its gradient is partial: f on the last `rope_dim` features.
    transformers' `mla_kv_a_proj`."""

    def __init__(self, rope_dim: int):
        super().__init__()
        if not isinstance(rope_dim, int) or rope_dim < 1:
            raise ValueError(f"rope_dim (qk_rope_head_dim) must be a positive int, got "
                             f"{rope_dim!r}")
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, rope = _group(device_mesh), self.rope_dim

        def post(mod, args, output):
            kept, k_rope = output.split([output.shape[-1] - rope, rope], dim=-1)
            k_rope = _ExplainedCopy.apply(
                k_rope, group, "mla_kv_a_proj f: the RoPE key skips the column-parallel "
                               "kv_b_proj and feeds every rank's heads: its gradient is "
                               "partial, summed over the TP group")
            return torch.cat([kept, k_rope], dim=-1)

        module.register_forward_hook(post)
        return module


class ScaleInput(TplabStyle):
    """Divide the input by the tp size: an identity expert inside experts whose outputs are
    summed over the tp group (g) would otherwise count tp times. transformers'
    `moe_identity_expert`."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        size = device_mesh.size()
        module.register_forward_pre_hook(lambda mod, args: (args[0] / size, *args[1:]))
        return module


class Styles(TplabStyle):
    """Several styles on one module, applied in order (a plan dict has one per key)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        if not styles or not all(isinstance(s, ParallelStyle) for s in styles):
            raise TypeError("Styles(*styles): one or more ParallelStyle objects")
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank
            module = style._apply(module, device_mesh)
        return module
