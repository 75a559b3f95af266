"""tplab's styles for activations: f and g on a module's inputs and outputs, each
collective carrying its style's reason (`tplab.parallel_styles`, whose docstring tells the
whole family; Shoeybi et al. 2019, section 3).

`PackedColwise` (a packed column-parallel layer), `MoEExperts`, `AllReduceOutput` (g),
`MlaKvAProj` (f on the RoPE key), `ScaleInput` (an identity expert); f and g with their
reason are `tplab.parallel_styles.explained`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from tplab.parallel_styles.explained import copy_with_cause, reduce_with_cause
from tplab.parallel_styles.weights import (
    LocalParams,
    ShardParameters,
    TplabStyle,
    packed_placement,
)
from tplab.style_specs import Collective, Handover, StyleSpec


def _why(collectives: tuple[Collective, ...]) -> str:
    return collectives[0].why


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

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """Each rank's rows of every packed block; a whole input (f), a local output."""
        rows = getattr(module, "out_features", 0)
        held = packed_rows(rows, self.split_factor, tp) if tp else (
            f"each rank holds its rows of each of the {self.split_factor} packed sub-matrices")
        packed = packed_placement(0, self.split_factor)
        return StyleSpec(
            params={name: packed for name, _ in module.named_parameters(recurse=False)},
            inputs=(Handover(Replicate(), Replicate(), True),),
            outputs=(Handover(packed_placement(-1, self.split_factor),
                              packed_placement(-1, self.split_factor), True),),
            modules=(nn.Linear,),
            divides=((f"out_features / {self.split_factor} (the rows of each packed "
                      "sub-matrix)", rows // self.split_factor),),
            backward=(Collective("all_reduce", f"packed_colwise f: {held}; the replicated "
                                 "input's gradient is the sum of the ranks' terms"),))

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
        group, cause = device_mesh.get_group(), _why(self.spec(module, tp).backward)

        def pre(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.redistribute(placements=[Replicate()]).to_local()
            return (copy_with_cause(x, group, cause), *args[1:])

        module.register_forward_pre_hook(pre)
        LocalParams()._apply(module, device_mesh)
        return module


class MoEExperts(TplabStyle):
    """Tensor-parallel MoE experts: every rank holds a slice of EVERY expert (gate_up
    packed colwise, down rowwise), so every rank runs every routed token through its slices:
    f on the tokens and on the routing weights (their gradients are partial), the forward on
    the local shards, g on the output (each rank's sum over experts is a partial sum of the
    hidden dim's terms). Parameters may be sharded by `ShardParameters` first (see
    `Styles`). transformers' `moe_tp_experts`."""

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """Whole tokens in (f), the summed output out (g); the parameters are
        ShardParameters' (see `Styles`)."""
        packed = getattr(module, "gate_up_proj", None)
        held = ""
        if tp and isinstance(packed, torch.Tensor) and packed.ndim == 3:
            held = f" ({packed_rows(packed.shape[1], 2, tp)} of gate_up, for every expert)"
        return StyleSpec(
            inputs=(Handover(Replicate(), Replicate(), True),),
            outputs=(Handover(Partial(), Replicate(), True),),
            forward=(Collective("all_reduce", "moe_tp_experts g: each rank's expert output "
                                "is a partial sum over its slice of the experts' hidden dim: "
                                "summed over the TP group"),),
            backward=(Collective("all_reduce", "moe_tp_experts f: every rank runs every "
                                 f"routed token through its slice of every expert{held}, so "
                                 "the tokens' and routing weights' gradients are partial: "
                                 "summed over the TP group"),),
            layouts_known=False)  # the routing inside is the model's own

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()
        spec = self.spec(module, device_mesh.size())
        f_cause, g_cause = _why(spec.backward), _why(spec.forward)

        def pre(mod, args, kwargs):
            hidden, *rest = args
            if isinstance(hidden, DTensor):
                hidden = hidden.to_local()
            hidden = copy_with_cause(hidden, group, f_cause)
            if len(rest) >= 2 and rest[1].requires_grad:  # top_k_index, top_k_weights
                rest[1] = copy_with_cause(rest[1], group, f_cause)
            elif "top_k_weights" in kwargs:
                kwargs = {**kwargs, "top_k_weights": copy_with_cause(kwargs["top_k_weights"],
                                                                     group, f_cause)}
            return (hidden, *rest), kwargs

        def post(mod, args, output):
            return None if output is None else reduce_with_cause(output, group, g_cause)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        LocalParams()._apply(module, device_mesh)
        module.register_forward_hook(post)
        return module


class AllReduceOutput(TplabStyle):
    """g on the module's output: each rank's output is a partial sum (a shared expert fed
    by sharded columns), summed over the tp group. transformers' `all_reduce`."""

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        return StyleSpec(
            outputs=(Handover(Partial(), Replicate(), True),),
            forward=(Collective("all_reduce", "all_reduce g: each rank's output is a partial "
                                "sum (fed by its shard of the columns): summed over the TP "
                                "group"),),
            layouts_known=False)  # which inputs make the partial sums is the module's own

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, cause = device_mesh.get_group(), _why(self.spec(module).forward)

        def post(mod, args, output):
            if isinstance(output, DTensor):
                output = output.to_local()
            return None if output is None else reduce_with_cause(output, group, cause)

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

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """The output's layout unchanged; f on its last rope_dim features."""
        return StyleSpec(backward=(Collective(
            "all_reduce", "mla_kv_a_proj f: the RoPE key skips the column-parallel kv_b_proj "
            "and feeds every rank's heads: its gradient is partial, summed over the TP group"),))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, rope = device_mesh.get_group(), self.rope_dim
        cause = _why(self.spec(module).backward)

        def post(mod, args, output):
            kept, k_rope = output.split([output.shape[-1] - rope, rope], dim=-1)
            k_rope = copy_with_cause(k_rope, group, cause)
            return torch.cat([kept, k_rope], dim=-1)

        module.register_forward_hook(post)
        return module


class ScaleInput(TplabStyle):
    """Divide the input by the tp size: an identity expert inside experts whose outputs are
    summed over the tp group (g) would otherwise count tp times. transformers'
    `moe_identity_expert`."""

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        return StyleSpec()  # the input's layout unchanged, its values divided: no collective

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        size = device_mesh.size()
        module.register_forward_pre_hook(lambda mod, args: (args[0] / size, *args[1:]))
        return module
