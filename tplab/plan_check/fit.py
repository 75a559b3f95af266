"""Does a plan fit the model? Checked before anything runs, on one device.

`check_plan` (also `tplab.plans.check_plan`): every key matches a module, each style fits
its module, and tp divides what it splits (features, query and key/value heads; the
vocabulary: `check_vocab`, with Megatron-LM's padding); then, given an example input,
`check_layouts`: do the plan's layouts chain along the model's dataflow?

`parallelize_module` installs each style's hooks without asking whether one module's
output is what the next module expects. A plain (local) tensor carries no placement:
`DTensor.from_local(x, mesh, input_layouts)` in the next style's input hook simply
*believes* its `input_layouts`. So a ColwiseParallel feeding a ColwiseParallel (a Shard(-1)
shard read as a whole Replicate() tensor) only shows up at run time, deep inside DTensor's
sharding propagation ("a and b must have same reduction dim"), with torch's fake-tensor
log on every rank. This module finds such mistakes before anything runs, and names both
modules, both placements and a fix.

How the dataflow is found: one forward pass of a copy of the model whose parameters are on
the meta device (no memory, no arithmetic), with the user's example input also on meta.
Each module's call records which planned module is called when, and a `TorchFunctionMode`
(`tplab.plan_check.tags`) carries a small tag on every activation: the layout it would have on
the ranks (a whole tensor, a local shard of dim d, a DTensor) and the module it came from,
moved along through views, transposes, pointwise ops and attention. Why not torch.fx or
torch.export: symbolic tracing fails on ordinary control flow (transformers' models), and
export needs the model to be export-clean; a forward on meta runs any model that runs, and
the tags follow the Python ops the model actually calls. Each hand-over is checked by
tplab/plan_check/handovers.py. Where the tag cannot be followed
(an op whose effect on the sharded dim is unknown, a style this module does not know: in
and below it), it is dropped and nothing downstream is checked: never a guess, never a
false alarm on a plan that chains. The forward runs in a thread of its own, each module
called through its own class, so that no mode (LocalTensorMode, CommDebugMode,
`tplab.trace`) and no module hook of the caller sees it.

What each style splits, expects and produces is its `tplab.style_specs.StyleSpec`, declared
once (torch's styles in `style_specs.TORCH_SPECS`, tplab's in their `spec` method): a plain
input is read as the spec says (a DTensor input is redistributed, so it always fits). A
style that declares none, or whose spec says its layouts cannot be followed, is skipped:
nothing in or below it is checked.

Mistakes found: a local shard read as another layout (Colwise into Colwise: Shard(-1) read
as Replicate(); a whole tensor into a Rowwise: Replicate() read as Shard(-1); a sequence
shard into a Colwise); a local shard of the dim a module needs whole (an unplanned
nn.Linear on its last dim, a norm over its normalized dims); a local shard combined with
a whole tensor in an op (a residual add after a Colwise left sharded); an op that reduces
over the sharded dim (F.layer_norm, softmax, h.norm(dim=-1), mean over it).
"""

from __future__ import annotations

import copy
import difflib
import inspect
import threading
import warnings
from fnmatch import fnmatch

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from tplab.core.pytrees import map_tensors
from tplab.errors import PlanError
from tplab.plan_check.handovers import Edge, HandoverHooks, tensors_of
from tplab.plan_check.tags import Flow, Tracer
from tplab.style_specs import StyleSpec, spec_of


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter, buffer and tensor attribute on the meta device
    (copy.deepcopy's memo maps each to its meta twin: no real data is copied)."""
    memo: dict = {}
    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(),
                      *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                twin = torch.empty(value.shape, dtype=value.dtype, device="meta")
                memo[id(value)] = (nn.Parameter(twin, value.requires_grad)
                                   if isinstance(value, nn.Parameter) else twin)
    return copy.deepcopy(model, memo)


def _on_meta(x):
    """Tensors (DTensors and simulated LocalTensors too) as meta tensors of their global
    shape."""
    return map_tensors(lambda t: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta"), x)


def match(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The (path, module) pairs a plan key selects, with parallelize_module's fnmatch rule."""
    found = [("", model)]
    for token in key.split(".") if key else []:
        found = [(f"{path}.{name}" if path else name, child)
                 for path, module in found for name, child in module.named_children()
                 if fnmatch(name, token)]
    return found


def styles_by_module(model: nn.Module, plan: dict) -> dict[str, list]:
    """{module path: [styles]} as parallelize_module applies a plan (fnmatch keys)."""
    found: dict[str, list] = {}
    for key, style in plan.items():
        for path, _ in match(model, key):
            found.setdefault(path, []).append(style)
    return found


# --- keys and sizes --------------------------------------------------------------------


PLAN_KINDS = ("a plan is a dict {module path: ParallelStyle()} such as {'w1': "
              "ColwiseParallel(), 'w2': RowwiseParallel()}, or a (model, mesh) -> model function")


def _what(obj) -> str:
    kind = type(obj).__name__
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind} ({obj!r:.60})"


def _style_error(obj, where: str) -> str | None:
    """Why `obj` is not a ParallelStyle instance, or None when it is one."""
    if isinstance(obj, ParallelStyle):
        return None
    if inspect.isclass(obj) and issubclass(obj, ParallelStyle):
        return (f"{where} is the class {obj.__name__}, not a style: write {obj.__name__}() "
                "(with parentheses)")
    if isinstance(obj, str):
        return (f"{where} is the string {obj!r}, not a style: write the style itself, "
                "ColwiseParallel() or RowwiseParallel() (from torch.distributed.tensor.parallel)")
    return f"{where} is {_what(obj)}, not a ParallelStyle (ColwiseParallel(), ...)"


def check_plan_type(plan, what: str = "plan") -> None:
    """Raise PlanError (one line) unless `plan` is a dict {str: ParallelStyle instance} or
    a function of (model, mesh): not None, a string, a list of pairs, a style or a style
    class where the plan or one of its values belongs."""
    if isinstance(plan, dict):
        for key, style in plan.items():
            if not isinstance(key, str):
                raise PlanError(f"{what} has a key {key!r} ({type(key).__name__}); keys are "
                                "module paths such as 'layers.*.attention.wq'")
            if (why := _style_error(style, f"{what}[{key!r}]")) is not None:
                raise PlanError(why)
        return
    if isinstance(plan, ParallelStyle) or (inspect.isclass(plan) and
                                           issubclass(plan, ParallelStyle)):
        raise PlanError(f"{_style_error(plan, what) or f'{what} is one style'}: a plan maps "
                        "module paths to styles, {'w1': ColwiseParallel(), ...}")
    if isinstance(plan, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                               for p in plan):
        raise PlanError(f"{what} is a {type(plan).__name__} of pairs; {PLAN_KINDS}: "
                        "dict(pairs) makes one")
    if not callable(plan):
        raise PlanError(f"{what} is {_what(plan)}; {PLAN_KINDS}")
    try:
        inspect.signature(plan).bind(None, None)
    except TypeError:
        raise PlanError(f"{what} {getattr(plan, '__name__', plan)!r:.60} cannot be called "
                        f"as plan(model, mesh); {PLAN_KINDS}") from None
    except ValueError:
        pass  # a signature that cannot be read: called as it is


def check_tp(tp, what: str = "check_plan") -> int:
    """`tp` as the tensor-parallel size: an int >= 1 (PlanError naming it otherwise)."""
    if tp is None:
        raise PlanError(f"{what}: give tp=, the number of tensor-parallel ranks (an int >= 1), "
                        "e.g. check_plan(model, plan, tp=2)")
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise PlanError(f"{what}: tp is the number of tensor-parallel ranks, an int >= 1, not "
                        f"{_what(tp)}")
    if tp < 1:
        raise PlanError(f"{what}: tp is the number of tensor-parallel ranks, at least 1, "
                        f"got {tp}")
    return tp


def check_plan(model: nn.Module, plan: dict, tp: int | None = None,
               example_input=None) -> None:
    """Raise PlanError if a key matches no module, a style does not fit its module, or a
    sharded dimension (or the number of heads) is not divisible by the tp size; given
    `example_input` (what the model is called with) and tp > 1, also if the layouts do not
    chain from one planned module to the next (`check_layouts`)."""
    check_plan_type(plan)
    if not isinstance(plan, dict):
        raise PlanError(f"check_plan checks a dict plan; a (model, mesh) -> model function "
                        f"is checked by running it (grad_check), got {_what(plan)}")
    tp = check_tp(tp)
    paths = [path for path, _ in model.named_modules() if path]
    for key, style in plan.items():
        found = match(model, key)
        if not found:
            close = difflib.get_close_matches(key, paths, n=3, cutoff=0.5) or paths[:6]
            close.sort(key=paths.index)  # in the model's order
            raise PlanError(f"plan key {key!r} matches no module of {type(model).__name__}; "
                            f"closest module paths: {', '.join(map(repr, close))}")
        for path, module in found:
            if (spec := spec_of(style, module)) is not None:
                _check_fit(model, path, module, style, spec, tp)
    # at tp = 1 every layout is the whole tensor: layouts that do not chain are right there
    if example_input is not None and tp > 1:
        check_layouts(model, plan, example_input)


def _kinds(classes: tuple[type, ...]) -> str:
    return " and ".join(f"nn.{c.__name__}" if c.__module__.startswith("torch.nn") else
                        c.__name__ for c in classes)


def _check_fit(model: nn.Module, path: str, module: nn.Module, style, spec: StyleSpec,
               tp: int) -> None:
    """The module is of a kind the style splits, tp divides what it splits (its spec's
    `divides`), and a projection that splits heads splits whole ones."""
    name = path or type(model).__name__
    kind = type(style).__name__
    if spec.modules and not isinstance(module, spec.modules):
        raise PlanError(f"{name} is a {type(module).__name__}; {kind} only splits "
                        f"{_kinds(spec.modules)}")
    for what, length in spec.divides:
        if length % tp:
            raise PlanError(f"{name}: {kind} splits {what} = {length} over tp = {tp} ranks, "
                            f"and {length} is not divisible by {tp}")
    if spec.heads:
        parent = model.get_submodule(path.rpartition(".")[0])
        _check_heads(parent, path, module, tp, path.rpartition(".")[0] or
                     type(model).__name__, name)


def _head_counts(parent: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) of an attention module: tplab's n_heads /
    n_kv_heads, or transformers' config.num_attention_heads / num_key_value_heads."""
    if getattr(parent, "n_heads", None) is None and not hasattr(parent, "head_dim"):
        return None, None   # not an attention module (an MLP may carry the config too)
    config = getattr(parent, "config", None)
    heads = getattr(parent, "n_heads", None) or getattr(config, "num_attention_heads", None)
    kv = (getattr(parent, "n_kv_heads", None) or getattr(config, "num_key_value_heads", None)
          or heads)
    return heads, kv


def _check_heads(parent, path, module, tp, pname, name) -> None:
    """A column-parallel projection of an attention module splits its heads: the query
    heads for q (and the output projection's input), the key/value heads for k and v."""
    heads, kv = _head_counts(parent)
    if heads is None:
        return
    head_dim = getattr(parent, "head_dim", None)
    is_kv = (kv != heads and head_dim is not None and module.out_features == kv * head_dim) or (
        kv != heads and path.rpartition(".")[2] in ("wk", "wv", "k_proj", "v_proj"))
    if is_kv and kv % tp:
        raise PlanError(f"{pname}: n_kv_heads = {kv} (key/value heads) is not divisible by "
                        f"tp = {tp}, so {name} would split a key/value head across ranks "
                        f"(the {heads} query heads are not the limit); past {kv} ranks each "
                        "rank needs its own copy of its group's KV heads (duplicated KV "
                        "heads, as Megatron-LM does when tp > num_query_groups)")
    if not is_kv and heads % tp:
        raise PlanError(f"{pname}: n_heads = {heads} is not divisible by tp = {tp}, so "
                        f"{name} would split a head across ranks (n_heads: the query heads)")


def padded_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM's padded vocabulary: the smallest multiple of `multiple` x tp (its
    --make-vocab-size-divisible-by, 128 by default) that holds `vocab_size` rows
    (megatron/training/tokenizer: _vocab_size_with_padding)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def check_vocab(vocab_size: int, tp: int, pad: bool = False, multiple: int = 128) -> int:
    """The vocabulary size to shard over `tp` ranks: `vocab_size` itself when tp divides it;
    otherwise, with `pad=True`, Megatron's padded size (`padded_vocab`) with a warning, and
    without, a PlanError that gives the sizes."""
    if vocab_size % tp == 0:
        return vocab_size
    padded = padded_vocab(vocab_size, tp, multiple)
    if not pad:
        raise PlanError(f"vocab_size = {vocab_size} is not divisible by tp = {tp} "
                        f"({vocab_size} = {vocab_size // tp} x {tp} + {vocab_size % tp}); pad "
                        f"it to {padded} (a multiple of {multiple} x {tp}, as Megatron-LM "
                        "does), e.g. model.resize_token_embeddings(...), or pass pad_vocab=True")
    warnings.warn(f"vocab_size = {vocab_size} is not divisible by tp = {tp}: padded to "
                  f"{padded} rows ({padded - vocab_size} unused), a multiple of {multiple} x "
                  f"{tp} as Megatron-LM pads; resize the embedding and lm head to match",
                  stacklevel=3)
    return padded


# --- layouts along the dataflow ----------------------------------------------------------


def check_layouts(model: nn.Module, plan: dict, example_input) -> list[Edge] | None:
    """Raise a PlanError naming both modules, both placements and a fix where one planned
    module's output does not fit what the next one reads (see the module docstring).

    `example_input` is what the model is called with (a tensor: model(x); a tuple or list:
    model(*x); a dict: model(**x), as `grad_check`'s make_input gives). Returns the
    hand-overs checked (producer, consumer, layout, expected) in dataflow order; None when
    the model could not run on the meta device (then nothing is checked: the plan is
    neither passed nor failed, and a PlanCheckSkipped warning says why) or is parallelised
    already."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        warnings.warn("plan check skipped: the model is parallelised already (its parameters "
                      "are DTensors); check the plan on the model as build_model() returns it",
                      PlanCheckSkipped, stacklevel=2)
        return None
    if isinstance(example_input, dict):
        args, kwargs = (), example_input
    elif isinstance(example_input, (tuple, list)) and not hasattr(example_input, "_fields"):
        args, kwargs = tuple(example_input), {}
    else:
        args, kwargs = (example_input,), {}
    edges = _trace(_meta_copy(model), plan, args, kwargs)
    if isinstance(edges, Exception):
        warnings.warn(skipped_because(edges), PlanCheckSkipped, stacklevel=2)
        return None
    return edges


class PlanCheckSkipped(UserWarning):
    """The layouts were not checked (the reason is in the message); nothing was judged."""


def skipped_because(exc: Exception) -> str:
    """Why the meta forward could not run, in words (for PlanCheckSkipped)."""
    text = (str(exc).strip().splitlines() or [""])[0][:160]
    said = f"{type(exc).__name__}: {text}"
    head = "plan check skipped, the layouts were not checked (grad_check still compares values)"
    if any(w in text for w in ("item() cannot be called on meta", "Cannot copy out of meta",
                               "data-independent", "data-dependent")):
        return (f"{head}: the model reads a value out of a tensor (data-dependent control "
                f"flow: .item(), `if tensor:`, a shape made of values), which a meta-device "
                f"forward cannot give ({said})")
    if any(w in text for w in ("shape", "size", "dim", "must match", "expected")):
        return (f"{head}: the model did not run on the example input; is its shape what the "
                f"model takes? ({said})")
    return f"{head}: the model did not run on the meta device ({said})"


def check_at_first_call(model: nn.Module, plan: dict) -> None:
    """Check the layouts when `model` is first called (for `apply_plan`, which has no
    example input): a pre-hook on the root, run before any style's hook, traces a meta
    copy taken now (whole shapes, before parallelize_module) with the call's own
    arguments, raises a PlanError before the parallel forward starts, and removes itself.
    The call's inputs may be the rank's own shards, so their layout is not assumed: what
    the planned modules hand on is checked (a Colwise into a Colwise), not what the model
    is fed (`check_layouts` with the whole example input checks that too)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    meta = _meta_copy(model)

    def first_call(module, args, kwargs):
        handle.remove()
        # what the ranks pass in may be their own shards (a sequence-parallel block fed
        # local Shard(1) pieces): the inputs' layout is unknown, only what planned modules
        # hand on is followed
        _trace(meta, plan, args, kwargs, whole_inputs=False)  # not run on meta: not checked

    handle = model.register_forward_pre_hook(first_call, prepend=True, with_kwargs=True)


def _trace(meta: nn.Module, plan: dict, args: tuple, kwargs: dict,
           whole_inputs: bool = True) -> list[Edge] | Exception:
    """One forward of the meta copy with the tracer, in a thread of its own: torch's mode
    stacks (dispatch and function modes: LocalTensorMode, CommDebugMode, tplab.trace) and
    grad mode are per thread, so nothing the caller has switched on sees this forward."""
    args, kwargs = _on_meta(args), _on_meta(kwargs)
    result: dict = {}

    def work():
        try:
            result["edges"] = _trace_here(meta, plan, args, kwargs, whole_inputs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name="tplab-plan-check")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["edges"]


def _trace_here(meta, plan, args, kwargs, whole_inputs: bool) -> list[Edge] | Exception:
    """The hand-overs checked, or the exception that stopped the meta forward."""
    planned = styles_by_module(meta, plan)
    edges: list[Edge] = []
    tracer = Tracer({})
    HandoverHooks(tracer, planned, edges).install(meta)
    for _, t in tensors_of((args, kwargs)) if whole_inputs else ():
        tracer.tag(t, Flow(Replicate()))  # as grad_check sends it: whole to every rank
    with torch.no_grad():
        try:
            with tracer:
                meta(*args, **kwargs)
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model that does not run on meta: not checked
            return exc
    return edges
