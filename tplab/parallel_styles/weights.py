"""tplab's styles for parameters: where a module's weights live and what their gradients
need (`tplab.parallel_styles`, whose docstring tells the whole family).

`ShardParameters` distributes bare parameters (packed ones by `packed_placement`),
`PackedRowwise` lays out packed rowwise weights, `LocalParams` runs a forward on the local
shards, `ReplicatedGradAllReduce` sums a replicated weight's partial gradient, and `Styles`
puts several on one module. Each declares what it does in `spec(module, tp)`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from tplab.style_specs import Collective, StyleSpec, spec_of


def packed_placement(dim: int, split_factor: int) -> Placement:
    """Each rank's slice of each of `split_factor` sub-matrices stacked on `dim`
    (`_StridedShard`: DTensor's name for "split each of the k blocks, not the whole")."""
    return _StridedShard(dim=dim, split_factor=split_factor)


class TplabStyle(ParallelStyle):
    """The base of these styles: a ParallelStyle that prints its arguments (torch's styles
    print their layouts) and declares what it does in `spec(module, tp=None)`."""

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec | None:
        """What the style does to `module` (tplab.style_specs); None: not declared."""
        return None

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

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """The placements given; tp divides each sharded dim (a packed one: each block)."""
        divides = []
        for name, p in self.placements.items():
            param = module._parameters.get(name)
            if isinstance(p, Shard) and param is not None and param.ndim:
                dim = p.dim % param.ndim
                blocks = getattr(p, "split_factor", 1)
                what = f"{name} dim {dim}" + (f" per packed block ({blocks})" if blocks > 1
                                                else "")
                divides.append((what, param.shape[dim] // blocks))
        return StyleSpec(params=dict(self.placements), divides=tuple(divides),
                         layouts_known=False)  # the forward is another style's (LocalParams)

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

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        # what the local math makes of the activations is the module's own
        return StyleSpec(layouts_known=False)

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

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec:
        """Replicated parameters, activations left alone, the gradient all-reduced."""
        return StyleSpec(params={name: Replicate() for name, _ in
                                 module.named_parameters(recurse=False)},
                         backward=(Collective("all_reduce", "replicated_with_grad_allreduce: "
                                              f"{REPLICATED_GRAD_RULE}"),))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._mesh = device_mesh
        # the trace's cause (tplab.causes reads `self.tp_cause` in the hook below)
        self.tp_cause = self.spec(module, device_mesh.size()).backward[0].why
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._sum_partial_grad)
        return module

    def _sum_partial_grad(self, param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=self._mesh.get_group())


class PackedRowwise(ShardParameters):
    """The weights of a packed layer laid out (.., in, packed out), as Llama 4's experts:
    each rank's slice of every sub-matrix on the last dim (`_StridedShard(-1, k)`); biases
    replicated. Parameters only, as transformers' `packed_rowwise`."""

    def __init__(self, names: dict[str, int], split_factor: int = 2):
        super().__init__({name: Replicate() if ndim == 1 else
                          packed_placement(ndim - 1, split_factor)
                          for name, ndim in names.items()})


class Styles(TplabStyle):
    """Several styles on one module, applied in order (a plan dict has one per key)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        if not styles or not all(isinstance(s, ParallelStyle) for s in styles):
            raise TypeError("Styles(*styles): one or more ParallelStyle objects")
        self.styles = styles

    def spec(self, module: nn.Module, tp: int | None = None) -> StyleSpec | None:
        """The styles' specs in order: their placements, the first input hook's and the
        last output hook's layouts, every size and collective; None if one declares none."""
        specs = [spec_of(style, module, tp) for style in self.styles]
        if None in specs:
            return None
        return StyleSpec(
            params={k: v for s in specs for k, v in s.params.items()},
            inputs=next((s.inputs for s in specs if s.inputs), ()),
            outputs=next((s.outputs for s in reversed(specs) if s.outputs is not None), None),
            modules=next((s.modules for s in specs if s.modules), ()),
            divides=tuple(d for s in specs for d in s.divides),
            heads=any(s.heads for s in specs),
            forward=tuple(c for s in specs for c in s.forward),
            backward=tuple(c for s in specs for c in s.backward),
            layouts_known=all(s.layouts_known for s in specs))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank
            module = style._apply(module, device_mesh)
        return module
