"""Why a collective ran, read from the Python stack when it is dispatched (both sides: a
rank traces its collectives, and so does a Simulation's in the notebook).

Every collective answers to something the lessons teach (Shoeybi et al. 2019, section 3;
docs/DESIGN.md): f, g, a DTensor redistribution. `tplab.trace` calls `find_cause` when a
collective is dispatched, and it reads the Python stack above that call, innermost first:

- inside DTensor's `redistribute_local_tensor` (torch.distributed.tensor._redistribute):
  the placements it converts, "Partial(sum) -> Replicate()", and, when a ParallelStyle's
  hook asked for it (`RowwiseParallel._prepare_output_fn`), which style and side;
- inside one of tplab's operators (`megatron.OPERATORS`): its Function's `label`, "f", "g"...;
- inside another autograd Function's forward or backward: "MyCopy.backward" and its line;
- otherwise the line of user code that issued it, "train.py:12 dist.all_reduce(x)".

What the causes mean, and each one's conjugate in the other pass, is tplab/explain.py
(`explain(records)`, `Trace.explain()`), which works on the records anywhere.
"""

from __future__ import annotations

import linecache
import os
import sys

import torch

from tplab.core import placements
from tplab.parallel_styles.weights import REPLICATED_GRAD_RULE

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TPLAB = os.path.dirname(os.path.abspath(__file__)) + os.sep  # tplab/
_STYLE_HOOKS = {"_prepare_input_fn": "input", "_prepare_output_fn": "output",
                "_prepare_out_fn": "output", "_prepare_input_kwarg_fn": "input",
                "_prepare_input_redistribute_fn": "input",
                "_prepare_output_redistribute_fn": "output"}
_MAX_DEPTH = 60


def _placements(spec) -> str:
    return ", ".join(placements.name(p) for p in spec.placements)


def _user_line(frame) -> str:
    code = frame.f_code
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
    return f"{where} {text}" if text else f"{where} in {code.co_name}"


def _function_node(frame):
    """The autograd node (ctx) of a custom Function's forward/backward frame, else None."""
    code = frame.f_code
    if code.co_name not in ("forward", "backward") or not code.co_varnames[:1] == ("ctx",):
        return None
    ctx = frame.f_locals.get("ctx")
    return ctx if isinstance(ctx, torch.autograd.function.FunctionCtx) else None


def _qualname(frame, node) -> str:
    """"CopyToTP.backward": the code's qualified name (Python 3.11+), else from the node."""
    code = frame.f_code
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    if node is not None:  # the node's class is "<Function>Backward"
        return f"{type(node).__name__.removesuffix('Backward')}.{code.co_name}"
    return code.co_name


def find_cause(skip: int = 1) -> tuple[str, object | None]:
    """(cause, node): why the collective being dispatched ran (see module doc), and the
    autograd node of the custom Function whose forward or backward issued it (None if
    none), so that the trace can say which module's input that Function guards."""
    frame = sys._getframe(skip + 1)
    redistribution = line = node = None
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        code = frame.f_code
        name, path = code.co_name, code.co_filename
        if path.startswith(_TORCH):
            if line is not None:
                break  # back in torch above the user's code: no Function of theirs
            if name == "redistribute_local_tensor" and redistribution is None:
                loc = frame.f_locals
                redistribution = (f"{_placements(loc['current_spec'])} -> "
                                  f"{_placements(loc['target_spec'])}")
            elif name in _STYLE_HOOKS and redistribution is not None:
                owner = _qualname(frame, None).split(".")[0]
                return f"{redistribution} ({owner} {_STYLE_HOOKS[name]})", node
            elif node is None:
                node = _function_node(frame)
        elif (declared := _declared_cause(frame)) is not None:
            return declared, _function_node(frame) or node
        elif path.startswith(_TPLAB) and (label := _label(frame)) is not None:
            return label, _function_node(frame) or node
        elif path.startswith(_TPLAB):
            pass  # tplab's own plumbing (the trace, the models, the rank runner)
        elif redistribution is not None:
            return redistribution, node
        else:
            own = _function_node(frame)
            if line is None:
                line = _user_line(frame)
            if own is not None:  # a hand-written autograd Function (not tplab's)
                return f"{_qualname(frame, own)}: {line}", own
        frame = frame.f_back
    return redistribution or line or "", node


def _label(frame) -> str | None:
    """The `label` of the tplab operator (an autograd Function or a hook, `tplab.megatron`)
    whose code this frame runs, None for tplab's plumbing."""
    own = _function_node(frame)
    owner = frame.f_globals.get(_qualname(frame, own).split(".")[0])
    label = getattr(owner, "label", None)
    return label if isinstance(label, str) else None


def _declared_cause(frame) -> str | None:
    """The cause a style or Function declares for its collectives: a `tp_cause` string on
    the frame's `self` (a tplab.parallel_styles style) or `ctx` (its autograd Functions, to
    which each style hands its StyleSpec's reason: tplab.style_specs), or
    the rule of the transformers style or Function whose code this is (`TRANSFORMERS_RULES`)."""
    module = frame.f_globals.get("__name__", "")
    if module.startswith("transformers.distributed"):
        owner = frame.f_globals.get(_qualname(frame, None).split(".")[0])
        return transformers_rules().get(owner) if isinstance(owner, type) else None
    if not module.startswith("tplab.parallel_styles"):
        return None
    for name in ("self", "ctx"):
        cause = getattr(frame.f_locals.get(name), "tp_cause", None)
        if isinstance(cause, str):
            return cause
    return None


def transformers_rules() -> dict[type, str]:
    """{transformers style or Function class: the rule its collective follows}, for the ones
    whose collectives run outside DTensor (so no placements say why); {} without
    transformers."""
    tp = sys.modules.get("transformers.distributed.tensor_parallel")
    utils = sys.modules.get("transformers.distributed.parallel_utils")
    if tp is None or utils is None:
        return {}
    rules = {getattr(tp, "ReplicatedWithGradAllReduce", None):
             f"replicated_with_grad_allreduce (transformers): {REPLICATED_GRAD_RULE}",
             getattr(utils, "_AllReduceBackward", None):
             "f (transformers' _AllReduceBackward): identity forward, all-reduce backward: a "
             "replicated input (tokens, routing weights, MLA's RoPE key) feeding every rank's "
             "shards gets one partial gradient per rank",
             getattr(utils, "_AllReduceForward", None):
             "g (transformers' _AllReduceForward): each rank's output is a partial sum (its "
             "slice of every expert); all-reduce forward, identity backward"}
    return {k: v for k, v in rules.items() if k is not None}
