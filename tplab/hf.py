"""Hugging Face transformers' published tensor-parallel plans, two ways.

transformers 5.x ships a `base_model_tp_plan` for most of its decoders: a dict of module
(or parameter) paths with wildcards and style names ("layers.*.self_attn.q_proj":
"colwise"), and applies it with its own DTensor code (transformers/distributed/
tensor_parallel.py, `apply_tensor_parallelism`, what `from_pretrained(tp_plan="auto")`
runs). tplab checks either:

- `apply_transformers_plan(model, mesh)`: transformers' own code, exactly as
  `from_pretrained(..., tp_plan="auto")` would apply it (the model's plan resolved by
  transformers, its wildcards expanded, its styles applied). A callable `(model, mesh) ->
  model`: `grad_check(lab, build, hf.apply_transformers_plan, make_input)`, or on the ranks.
- `from_hf(config_or_model)`: the same plan translated into DTensor styles, a plain dict for
  `tplab.apply_plan`/`describe_plan`: torch's own styles where one exists, tplab's
  (`tplab.parallel_styles`) for the rest, so every layout can be read, traced and changed.

Every style in transformers' `ALL_PARALLEL_STYLES` that is tensor parallel is translated
(`HF_SUPPORTED`), those of 5.24 and of 5.25 alike (5.25 adds `unit_colwise`/`unit_rowwise`,
whole heads on a 2-D view of the ranks: `parallel_styles.UnitColwise`; drops
`moe_identity_expert`; deprecates `moe_tp_experts`, and its MoE plans leave the experts
whole under TP: `from_hf(..., overrides=...)` gives them the 5.24 rules). Its
expert-parallel styles (`ep_dispatch_experts`, `grouped_gemm`) need transformers'
token-dispatch runtime: `from_hf` points to `apply_transformers_plan` (with a
`DistributedConfig(ep_size=...)` of transformers) for them.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from tplab.errors import PlanError
from tplab.mesh import tp_mesh
from tplab.parallel_styles.activations import (
    AllReduceOutput,
    MlaKvAProj,
    MoEExperts,
    PackedColwise,
    ScaleInput,
)
from tplab.parallel_styles.heads import UnitColwise, UnitRowwise
from tplab.parallel_styles.weights import (
    LocalParams,
    ReplicatedGradAllReduce,
    ShardParameters,
    Styles,
    packed_placement,
)
from tplab.plan_check.fit import check_vocab

# transformers' style name -> a torch DTensor style for a module (None: nothing to plan)
_TORCH_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    "replicate": lambda: None,  # every rank keeps the whole parameter: nothing to plan
}
# ... and a tplab style (tplab.parallel_styles) for those torch does not ship
# (transformers 5.25 adds unit_colwise/unit_rowwise, drops moe_identity_expert and deprecates
# moe_tp_experts: both kept here for the plans of 5.24, which publishes them)
_TPLAB_STYLES = ("replicated_with_grad_allreduce", "packed_colwise", "packed_rowwise",
                 "moe_tp_experts", "mla_kv_a_proj", "all_reduce", "moe_identity_expert",
                 "local_params", "unit_colwise", "unit_rowwise")
EP_STYLES = ("ep_dispatch_experts", "grouped_gemm")
HF_SUPPORTED = tuple(sorted([*_TORCH_STYLES, *_TPLAB_STYLES]))


# --- transformers' own code ---------------------------------------------------------------

def transformers_plan(model: nn.Module, tp: int, overrides: dict | None = None) -> dict:
    """transformers' resolved plan for `model` at tp ranks: {concrete module or parameter
    path: style name}, wildcards expanded to layer numbers, as `from_pretrained` resolves it
    (`model._resolve_parallel_plans(DistributedConfig(tp_size=tp, tp_plan=...))`).
    `overrides` replaces single rules, as `DistributedConfig(tp_plan={...})` does."""
    from transformers.distributed import DistributedConfig

    if not hasattr(model, "_resolve_parallel_plans"):
        raise TypeError(f"a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(tp, int) or tp < 2:
        raise ValueError(f"tp must be an int of at least 2, got {tp!r}")
    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(f"overrides: a dict {{path: style name}}, got {type(overrides)}")
    config = DistributedConfig(tp_size=tp, tp_plan=overrides if overrides else "auto")
    try:
        plan, _, _ = model._resolve_parallel_plans(config)
    except ValueError as e:
        raise PlanError(f"{type(model).__name__}: transformers refuses the plan: {e}") from e
    return plan


def apply_transformers_plan(model: nn.Module, mesh, overrides: dict | None = None
                            ) -> nn.Module:
    """Rank side: shard `model` with its published plan by transformers' own code, as
    `from_pretrained(..., tp_plan="auto")` does: resolve the plan (`transformers_plan`),
    then `transformers.distributed.tensor_parallel.apply_tensor_parallelism` on the tp
    mesh. Each rank cuts its shard from its own full copy of the weights (transformers'
    `src_data_rank=None`), so every rank must hold the same weights first (grad_check loads
    them). Returns the model; usable as grad_check's plan."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = tp_mesh(mesh)
    check_heads(model, mesh.size(), overrides)  # before transformers' code cuts a head in two
    plan = transformers_plan(model, mesh.size(), overrides)
    model._tp_size = mesh.size()     # what maybe_distribute_model records for the model
    model._device_mesh = mesh
    if getattr(model, "_mesh_manager", None) is None:
        model._mesh_manager = _mesh_manager(mesh)
    tied = _untie(model, plan)
    model = apply_tensor_parallelism(model, mesh, plan)
    _retie(model, tied)
    return model


def _mesh_manager(mesh):
    """transformers' holder of a model's meshes (`TransformersDeviceMesh`), the tp mesh as
    its dense and expert mesh: what its unit styles (5.25: `unit_colwise`) ask for their
    2-D view of the tp ranks (`get_unit_mesh`)."""
    try:
        from transformers.distributed.utils import TransformersDeviceMesh
    except ImportError:  # a transformers without it has no unit styles to ask
        return None
    return TransformersDeviceMesh(mesh, mesh)


def check_heads(model: nn.Module, tp: int, overrides: dict | None = None) -> None:
    """PlanError unless tp divides the model's heads (`config.num_attention_heads`, and
    the key/value heads of a grouped-KV model): what transformers' plan splits. Not the
    key/value heads where the plan (with `overrides`) gives the key and value projections
    `unit_colwise`, which keeps whole heads (one on several ranks when there are fewer)."""
    config = getattr(model, "config", None)
    if config is not None:
        plan = dict(getattr(model, "tp_plan", None) or {}) | dict(overrides or {})
        _check_heads(config, tp, kv=_splits_kv_heads(plan))


def _splits_kv_heads(plan: dict) -> bool:
    """Whether the plan may split key/value heads: False only where every key and value
    projection is `unit_colwise` (whole heads, one on several ranks when there are fewer)."""
    keys = [style for key, style in plan.items() if key.rsplit(".", 1)[-1] in
            ("k_proj", "v_proj", "qkv_proj", "query_key_value")]
    return not keys or any(style != "unit_colwise" for style in keys)


apply_transformers_plan.check_plan = check_heads  # grad_check runs it before the ranks


def _untie(model: nn.Module, plan: dict) -> list[tuple[str, str]]:
    """from_pretrained shards a model before it ties its weights (lm_head to the embedding):
    give each tied alias the plan names its own parameter, as it is then. Returns the
    (alias, source) pairs to tie again after sharding."""
    first = {id(p): n for n, p in model.named_parameters()}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if first[id(p)] != name and name in plan:
            owner, _, pname = name.rpartition(".")
            model.get_submodule(owner)._parameters[pname] = nn.Parameter(
                p.detach().clone(), requires_grad=p.requires_grad)
            tied.append((name, first[id(p)]))
    return tied


def _retie(model: nn.Module, tied: list[tuple[str, str]]) -> None:
    """Tie again (as from_pretrained's tie_weights does after loading) where both sides got
    the same layout; else they stay two parameters (grad_check says so)."""
    for alias, source in tied:
        owner, _, pname = alias.rpartition(".")
        a, b = model.get_parameter(alias), model.get_parameter(source)
        if getattr(a, "placements", None) == getattr(b, "placements", None) and \
                a.shape == b.shape:
            model.get_submodule(owner)._parameters[pname] = b


# --- translation into DTensor styles -----------------------------------------------------

def _param_placement(style: str, p: torch.Tensor, name: str):
    """The placement transformers gives a bare parameter under `style`
    (its `shard_param` methods), or None when it stays whole."""
    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        return Shard(max(p.ndim - 2, 0))
    if style in ("rowwise", "rowwise_rep", "rowwise_split_input"):
        return Replicate() if name == "bias" or p.ndim == 1 else Shard(p.ndim - 1)
    if style == "packed_colwise":
        return packed_placement(max(p.ndim - 2, 0), 2)
    if style == "packed_rowwise":
        return Replicate() if p.ndim == 1 else packed_placement(p.ndim - 1, 2)
    if style == "embedding_rowwise":
        return Shard(0)
    if style == "embedding_colwise":
        return Shard(p.ndim - 1)
    return None


def _module_style(style: str, config):
    if style in _TORCH_STYLES:
        return _TORCH_STYLES[style]()
    if style == "replicated_with_grad_allreduce":
        return ReplicatedGradAllReduce()
    if style == "packed_colwise":
        return PackedColwise()
    if style == "moe_tp_experts":
        return MoEExperts()
    if style == "all_reduce":
        return AllReduceOutput()
    if style == "moe_identity_expert":
        return ScaleInput()
    if style == "local_params":
        return LocalParams()
    if style in ("unit_colwise", "unit_rowwise"):
        return (UnitColwise if style == "unit_colwise" else UnitRowwise)(_head_dim(config))
    if style == "mla_kv_a_proj":
        rope = getattr(config, "qk_rope_head_dim", None)
        if rope is None:
            raise PlanError(f"{type(config).__name__}: mla_kv_a_proj needs qk_rope_head_dim "
                            "in the config")
        return MlaKvAProj(rope)
    raise AssertionError(style)


def _head_dim(config) -> int:
    """The head size transformers' unit styles split by: `head_dim`, else hidden/heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or (
        text.hidden_size // text.num_attention_heads)
    return int(head_dim)


def _meta_model(config):
    """The base model of `config` on the meta device (no memory), to tell module keys from
    parameter keys; None if transformers cannot build it."""
    try:
        from transformers import AutoModel

        with torch.device("meta"):
            return AutoModel.from_config(config)
    except Exception:
        return None


def _params_of(tree: nn.Module | None, key: str) -> tuple[str, str] | None:
    """(module key, parameter name) when the plan key names a bare parameter of `tree`."""
    if tree is None:
        return None
    module_key, _, name = key.rpartition(".")
    for path, module in tree.named_modules():
        if _matches(path, module_key) and name in module._parameters:
            return module_key, name
    return None


def _matches(path: str, key: str) -> bool:
    parts, tokens = path.split(".") if path else [], key.split(".") if key else []
    return len(parts) == len(tokens) and all(fnmatch(p, t) for p, t in
                                             zip(parts, tokens, strict=True))


def _normalise_prefix(prefix) -> str:
    if prefix is None:
        return ""
    if not isinstance(prefix, str):
        raise PlanError(f"prefix is a module path such as 'model.', got {prefix!r}")
    if prefix and not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.?", prefix):
        raise PlanError(f"prefix {prefix!r} is not a module path such as 'model.'")
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _published(config_or_model, prefix: str, overrides: dict | None) -> dict:
    """The plan transformers publishes for a model or config (see from_hf), overrides in."""
    config = getattr(config_or_model, "config", config_or_model)
    if isinstance(config_or_model, nn.Module) and not prefix:
        published = dict(getattr(config_or_model, "tp_plan", None) or {})
    else:  # a config, or a model given a prefix: its base model's keys, prefixed
        published = {prefix + k: v for k, v in
                     (getattr(config, "base_model_tp_plan", None) or {}).items()}
    if overrides is not None:
        if not isinstance(overrides, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in overrides.items()):
            raise PlanError(f"overrides: a dict {{path: style name}}, got {overrides!r:.60}")
        published |= overrides
    return published


def from_hf(config_or_model, prefix: str | None = None, *, tp: int | None = None,
            pad_vocab: bool = False, overrides: dict | None = None) -> dict:
    """A DTensor plan from transformers' published one, its wildcards kept
    ("model.layers.*.self_attn.q_proj"), every style translated (`HF_SUPPORTED`).

    Given a model, the plan is the model's own `tp_plan` (its class's `_tp_plan`, such as
    Llama's lm_head "colwise_gather_output", the config's `base_model_tp_plan` under the base
    model's prefix, and the vocabulary-sharded embedding transformers adds). Given a config,
    it is the config's `base_model_tp_plan`, keys prefixed with `prefix` ("" by default, for
    the base model such as `LlamaModel`; "model." or "model" for `LlamaForCausalLM`).

    Rules that name nothing in the model (Qwen3-MoE's dense-layer MLP rules in an all-MoE
    model) are left out, as transformers leaves them out (it warns).
    Keys naming a bare parameter (stacked MoE expert weights) become `ShardParameters` of
    their module, combined with the module's own style (`parallel_styles.Styles`). Checks,
    in this order: a published plan exists; with `tp=N`, the heads (the key/value heads of a
    grouped-KV model, unless its key and value projections are `unit_colwise`, keeping a head
    whole on several ranks; else the query heads) and the vocabulary (`check_vocab`: padded with a
    warning when `pad_vocab=True`) divide by N. An expert-parallel style raises a PlanError
    that points to `apply_transformers_plan`. `overrides` ({key: style name}, keys as the
    plan's: a model's full paths) replaces or adds single rules, as
    `apply_transformers_plan(model, mesh, overrides)` and `DistributedConfig(tp_plan=...)`
    do: e.g. the MoE experts' rules of transformers 5.24 on a model of 5.25, whose plan
    leaves the experts whole on every rank.
    """
    config = getattr(config_or_model, "config", config_or_model)
    is_model = isinstance(config_or_model, nn.Module)
    if not is_model and not hasattr(config, "model_type"):
        raise PlanError(f"from_hf takes a transformers model or its config, not "
                        f"{type(config_or_model).__name__} {config_or_model!r:.40}: e.g. "
                        "from_hf(model), from_hf(AutoConfig.from_pretrained(name)) or "
                        "from_hf(LlamaConfig(...), prefix='model.') for LlamaForCausalLM")
    prefix = _normalise_prefix(prefix)
    published = _published(config_or_model, prefix, overrides)
    if not published:
        raise PlanError(f"{type(config).__name__} publishes no base_model_tp_plan: "
                        "transformers has no tensor-parallel plan for this model; write "
                        "one (a dict {module path: ParallelStyle})")
    if tp is not None:
        _check_config(config, tp, pad_vocab, kv=_splits_kv_heads(published))
    for key, name in published.items():
        if name in EP_STYLES:
            raise PlanError(f"{key}: {name!r} is an expert-parallel style of transformers: it "
                            "needs transformers' token-dispatch runtime; apply the plan with "
                            "tplab.hf.apply_transformers_plan (transformers' own code)")
        if name not in HF_SUPPORTED:
            raise PlanError(f"{key}: transformers' tp_plan style {name!r} is unknown to "
                            f"tplab.hf.from_hf; known: {', '.join(HF_SUPPORTED)}")
    tree = config_or_model if is_model else _meta_model(config)
    if tree is not None and not is_model and prefix:
        tree = _Prefixed(prefix.rstrip("."), tree)
    return _translate(published, tree, config)


class _Prefixed(nn.Module):
    """A base model seen under a prefix (its CausalLM's "model."), to match prefixed keys."""

    def __init__(self, name: str, base: nn.Module):
        super().__init__()
        self.add_module(name, base)


def _translate(published: dict, tree, config) -> dict:
    modules: dict[str, list] = {}
    params: dict[str, dict] = {}
    paths = None if tree is None else [path for path, _ in tree.named_modules()]
    for key, name in published.items():
        owner = _params_of(tree, key)
        if owner is None and paths is not None and not any(_matches(p, key) for p in paths):
            continue  # a rule that names nothing in this model: transformers skips it too
        if owner is None:
            modules.setdefault(key, []).append(name)
            continue
        module_key, pname = owner
        p = next(m._parameters[pname] for path, m in tree.named_modules()
                 if _matches(path, module_key) and pname in m._parameters)
        placement = _param_placement(name, p, pname)
        if placement is not None:
            params.setdefault(module_key, {})[pname] = placement
        modules.setdefault(module_key, [])
    plan = {}
    for key, names in modules.items():
        styles = [ShardParameters(params[key])] if key in params else []
        styles += [s for s in (_module_style(n, config) for n in names) if s is not None]
        if styles:
            plan[key] = styles[0] if len(styles) == 1 else Styles(*styles)
    return plan


def _check_config(config, tp: int, pad_vocab: bool, kv: bool = True) -> None:
    """A transformers config's head counts and vocabulary against tp ranks: the KV heads
    only for a grouped-KV model (fewer KV heads than query heads), else the query heads."""
    _check_heads(config, tp, kv)
    vocab = getattr(config, "vocab_size", None)
    if vocab:
        check_vocab(vocab, tp, pad=pad_vocab)


def _check_heads(config, tp: int, kv: bool = True) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise PlanError(f"tp must be a positive int, got {tp!r}")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    name = type(config).__name__
    if kv and heads is not None and kv_heads is not None and kv_heads != heads and \
            kv_heads % tp:
        raise PlanError(f"{name}: num_key_value_heads = {kv_heads} (key/value heads) is not "
                        f"divisible by tp = {tp}; the {heads} query heads are not the limit, "
                        f"the KV heads are: past {kv_heads} ranks each rank needs a copy of its "
                        "group's KV heads (duplicated KV heads)")
    if heads is not None and heads % tp:
        raise PlanError(f"{name}: num_attention_heads = {heads} (query heads) is not "
                        f"divisible by tp = {tp}")
