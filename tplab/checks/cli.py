"""`python -m tplab check MOD:build MOD:plan MOD:make_input --world-size N`: grad_check
from the command line, for a user's CI.

Each MOD:NAME names an object in an importable module (the current directory is on the
path, here and on the ranks). `build` and `make_input` take no arguments (as in
`tplab.grad_check`); `plan` is a dict, a function of no arguments that returns one
(`tplab.plans:mlp`), or a `(model, mesh) -> model` function. `--loss MOD:fn` is the
loss_fn. `--simulated` runs the ranks in this process (`tplab.simulate`).

Prints the report. Exit status:
- 0 when the check passes;
- 1 when it fails: a wrong gradient, a PlanError (a key that matches nothing, layouts that
  do not chain: `tplab.plan_check`), or the user's code failing (a loss that is not a
  scalar, an exception or `sys.exit()` in build, make_input, plan or loss), each told in
  one line (`--traceback` prints the whole traceback as well);
- 2 on bad arguments, all checked before anything starts (`validate`): a name that does
  not resolve, a world size this machine cannot run, a build/make_input/loss that is not
  callable, a plan that is neither a dict of ParallelStyles nor a function, a negative or
  non-finite tolerance. One line names the argument.

Where each step lives: `parser()` (the flags), `validate()` (every argument check),
`preflight()` (the user's code once on one device and the static plan check, before any
rank starts), `run()` (the lab and grad_check). A new flag gets a line in each that needs it.

`--train STEPS` checks a training run instead (`tplab.train_check`): the third name is then
`make_batch(i)` (one of no arguments gives the same batch every step), `--step MOD:fn` the
training step `step(model, optimizer, batch) -> loss` (default: forward, `--loss`,
backward, AdamW step).

`--dp N` checks on a (dp, tp) mesh, tp = world size / N, data parallel over dp: a plan
function gets the whole mesh and may apply TP on mesh["tp"], then FSDP2 on mesh["dp"]
(`tplab.fsdp.fsdp_tp`, torchtitan's order).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import math
import os
import re
import sys
import traceback

from torch.distributed.tensor.parallel import ParallelStyle

import tplab
from tplab.core.pytrees import call_model
from tplab.errors import LabError, PlanError, RankError, format_rank_list
from tplab.lab.arguments import MAX_LOCAL_RANKS, check_launch_args
from tplab.lab.engines.local import LocalKind
from tplab.losses import call_loss
from tplab.plans import parallelizer


class BadArgument(Exception):
    """An argument that is wrong before anything runs (exit status 2)."""


class UserCodeFailed(Exception):
    """The user's own code failed (exit status 1), told in one line."""


@dataclasses.dataclass
class Targets:
    """The validated arguments."""

    build: object
    plan: object
    make_input: object
    loss: object
    world_size: int
    simulated: bool
    atol: float | None
    rtol: float | None
    show_traceback: bool
    train: int | None = None  # --train STEPS: train_check instead of grad_check
    step: object = None  # --step MOD:fn, the user's training step
    dp: int | None = None  # --dp N: a (dp, tp) mesh, the plan gets it (FSDP2 x TP)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tplab check",
        description="grad_check a tensor-parallel model against its single-device self")
    p.add_argument("build", help="MOD:NAME of build_model()")
    p.add_argument("plan", help="MOD:NAME of the plan (dict, factory or callable)")
    p.add_argument("make_input", help="MOD:NAME of make_input()")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--loss", help="MOD:NAME of loss_fn(output[, input])")
    p.add_argument("--simulated", action="store_true",
                   help="simulated ranks in this process (tplab.simulate)")
    p.add_argument("--dp", type=int, metavar="N",
                   help="data-parallel degree: a (dp, tp) mesh with tp = world size / N; the "
                        "plan gets the whole mesh (FSDP2 x TP: tplab.fsdp.fsdp_tp)")
    # None: grad_check's own, which follow the model's dtype (tplab.checks.grad.TOLERANCES)
    p.add_argument("--atol", type=float, default=None)
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--traceback", action="store_true", dest="show_traceback",
                   help="print the whole traceback of a failure, not only its line")
    p.add_argument("--train", type=int, metavar="STEPS",
                   help="train_check STEPS training steps instead of one grad_check")
    p.add_argument("--step", help="MOD:NAME of step(model, optimizer, batch) -> loss "
                                  "(with --train)")
    return p


# --- arguments ----------------------------------------------------------------------------


def _import(module_name: str):
    """The module; tplab's public short names too (`tplab.megatron`: tplab/megatron/)."""
    head, _, short = module_name.partition(".")
    if head == "tplab" and short in tplab.MODULES:
        module_name = tplab.MODULES[short]
    return importlib.import_module(module_name)


def resolve(spec: str, argument: str = "argument"):
    """The object MOD:NAME (NAME may be dotted: MOD:Class.method)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadArgument(f"{argument}: {spec!r} is not MODULE:NAME (e.g. mypkg.model:build)")
    try:
        obj = _import(module_name)
    except ImportError as exc:
        raise BadArgument(f"{argument}: cannot import {module_name!r} (from {spec!r}): "
                          f"{exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - the module's own code failed on import
        raise UserCodeFailed(f"{argument}: importing {module_name!r} raised "
                             f"{_line(exc)}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise BadArgument(f"{argument}: {module_name!r} has no {attr!r}; it has: "
                              f"{', '.join(names[:12])}")
        obj = getattr(obj, part)
    return obj


def _required(fn) -> int | None:
    """How many positional arguments `fn` needs (None: its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def _takes(fn, n: int) -> bool:
    """Whether `fn` can be called with n positional arguments (True: unreadable)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:
        pass
    return True


def _a(obj) -> str:
    kind = type(obj).__name__
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"


def _callable(obj, argument: str, spec: str, takes: str) -> None:
    if not callable(obj):
        raise BadArgument(f"{argument}: {spec} is {_a(obj)} ({obj!r:.60}), not a function; "
                          f"{argument} is a function of {takes}")


def _check_world_size(world_size: int, simulated: bool) -> None:
    if world_size < 1:
        raise BadArgument(f"--world-size must be at least 1, got {world_size}")
    if simulated:
        if world_size > MAX_LOCAL_RANKS:
            raise BadArgument(f"--world-size {world_size} is more than a simulated lab runs: "
                              f"it holds every tensor once per rank; at most "
                              f"{MAX_LOCAL_RANKS} ranks")
        return
    try:
        check_launch_args(world_size, "auto", "127.0.0.1")
        LocalKind().check_size(world_size, "auto")
    except (LabError, TypeError, ValueError) as exc:  # more than this machine can run
        raise BadArgument(f"--world-size {world_size}: {exc}") from exc


def _check_tolerance(value: float | None, flag: str) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value < 0:
        raise BadArgument(f"{flag} must be a finite number >= 0, got {value!r} "
                          "(with it every row would be judged wrong, or none)")
    return value


def _check_plan(obj, spec: str):
    """A dict of ParallelStyles, a factory of one (called here), or (model, mesh) -> model."""
    what = ("a plan is a dict {module path: ParallelStyle}, a function of no arguments "
            "returning one, or a (model, mesh) -> model function")
    if callable(obj) and not isinstance(obj, dict):
        need = _required(obj)
        if need == 0:
            try:
                made = obj()
            except BaseException as exc:  # noqa: BLE001 - the user's factory failed
                raise UserCodeFailed(f"plan: {spec}() raised {_line(exc)}") from exc
            if callable(made) and not isinstance(made, dict):
                return _check_plan(made, f"{spec}()")
            if not isinstance(made, dict):
                raise BadArgument(f"plan: {spec}() returned {_a(made)}; {what}")
            obj, spec = made, f"{spec}()"
        elif need is not None and need != 2:
            raise BadArgument(f"plan: {spec} takes {need} arguments; {what}")
        else:
            return obj
    if not isinstance(obj, dict):
        raise BadArgument(f"plan: {spec} is {_a(obj)} ({obj!r:.60}); {what}")
    for key, style in obj.items():
        if not isinstance(key, str):
            raise BadArgument(f"plan: {spec} has a key {key!r} ({type(key).__name__}); keys "
                              "are module paths such as 'layers.*.attention.wq'")
        if not isinstance(style, ParallelStyle):
            raise BadArgument(f"plan: {spec}[{key!r}] is {_a(style)} ({style!r:.40}), not a "
                              "ParallelStyle (ColwiseParallel(), ...)")
    return obj


def batches(make):
    """make_batch(i) from a function of the step, or of nothing (the same batch each step)."""
    try:
        takes_step = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                         for p in inspect.signature(make).parameters.values())
    except (TypeError, ValueError):
        takes_step = True
    if takes_step:
        return make
    return functools.partial(_same_batch, make)


def _same_batch(make, i):
    return make()


def validate(args: argparse.Namespace) -> Targets:
    """Every argument, checked before anything starts: BadArgument (exit 2) names it."""
    _check_world_size(args.world_size, args.simulated)
    if args.train is not None and args.train < 1:
        raise BadArgument(f"--train STEPS must be >= 1, got {args.train}")
    if args.step and args.train is None:
        raise BadArgument("--step is for a training run: give --train STEPS too")
    atol, rtol = _check_tolerance(args.atol, "--atol"), _check_tolerance(args.rtol, "--rtol")
    build = resolve(args.build, "build")
    _callable(build, "build", args.build, "no arguments that returns the model")
    if args.train is None:
        make_input = resolve(args.make_input, "make_input")
        _callable(make_input, "make_input", args.make_input,
                  "no arguments that returns the input")
    else:  # the third name is make_batch(i), or a function of nothing
        make_input = resolve(args.make_input, "make_batch")
        _callable(make_input, "make_batch", args.make_input,
                  "the step i (or of nothing) that returns the batch")
        make_input = batches(make_input)
    if args.step and args.loss:
        raise BadArgument(f"--loss {args.loss} with --step {args.step}: the step computes its "
                          "own loss (forward, loss, backward, optimizer.step()), so --loss "
                          "would be ignored; give one of them")
    step = resolve(args.step, "--step") if args.step else None
    if step is not None:
        _callable(step, "--step", args.step, "(model, optimizer, batch) that returns the loss")
        if not _takes(step, 3):
            raise BadArgument(f"--step: {args.step} takes {_required(step)} arguments; a step "
                              "is a function of (model, optimizer, batch) that returns the "
                              "loss")
    loss = resolve(args.loss, "--loss") if args.loss else None
    if loss is not None:
        _callable(loss, "--loss", args.loss, "(output[, input]) that returns a scalar")
    plan = _check_plan(resolve(args.plan, "plan"), args.plan)
    dp = _check_dp(getattr(args, "dp", None), args.world_size)
    return Targets(build, plan, make_input, loss, args.world_size, args.simulated, atol, rtol,
                   args.show_traceback, args.train, step, dp)


def _check_dp(dp, world_size: int) -> int | None:
    """--dp: a positive int that divides the world size (None: tp = the world size)."""
    if dp is not None and (dp < 1 or world_size % dp):
        raise BadArgument(f"--dp {dp} must be a positive int that divides --world-size "
                          f"{world_size}")
    return dp


# --- the user's code, then the lab --------------------------------------------------------


def _line(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) (sys.exit() in the user's code)"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _user(step: str, fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt aside, one line
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, PlanError) and not isinstance(exc, RankError):
            raise
        if isinstance(exc, LabError) and not isinstance(exc, RankError):  # tplab's own words
            raise UserCodeFailed(f"{step}: {str(exc).splitlines()[0]}") from exc
        raise UserCodeFailed(f"{step} raised {_line(exc)}") from exc


def preflight(t: Targets) -> None:
    """build, make_input, the static plan check (`plans.check_plan` with the input: keys,
    divisibility, layouts along the dataflow) and one forward and loss on one device,
    before any rank starts."""
    model = _user("build()", t.build)
    x = (_user("make_input()", t.make_input) if t.train is None
         else _user("make_batch(0)", t.make_input, 0))
    parallelizer(t.plan, model, t.world_size // (t.dp or 1), x)  # a PlanError: exit 1
    out = _user("the model's forward on one device", call_model, model, x)
    if t.loss is not None and t.step is None:
        _user("--loss", call_loss, t.loss, out, x)


def run(t: Targets) -> int:
    """The lab and grad_check (or train_check): 0 when it passes, 1 when it fails."""
    lab = tplab.simulate(t.world_size) if t.simulated else tplab.launch(t.world_size)
    try:
        if t.train is not None:
            report = _user("train_check", functools.partial(
                tplab.train_check, step=t.step, loss_fn=t.loss, live=False, dp=t.dp),
                lab, t.build, t.plan, t.make_input, t.train)
        else:
            report = _user("grad_check", functools.partial(tplab.grad_check, dp=t.dp), lab,
                           t.build, t.plan, t.make_input, t.loss, t.atol, t.rtol)
    finally:
        lab.shutdown()
    print(report)
    return 0 if report.ok else 1


def _rank_line(exc) -> str:
    """A RankError in one line: the exception's own line on the first rank, and where."""
    rank, tb = next(iter(exc.tracebacks.items()))
    name = exc.enames.get(rank) or r"\w+(?:Error|Exception|Exit|Interrupt)"
    lines = [ln for ln in tb.splitlines() if re.match(rf"({name}|[\w.]+\.{name}):", ln)]
    last = lines[-1] if lines else tb.strip().splitlines()[-1]
    return f"{last.strip()} (on {format_rank_list(exc.ranks)})"


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # argparse: a malformed command line (2), or --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    sys.path.insert(0, os.getcwd())
    # the ranks import the same modules by name: give them this directory too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    show = getattr(args, "show_traceback", False)
    try:
        targets = validate(args)
        preflight(targets)
        return run(targets)
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (UserCodeFailed, LabError) as exc:
        cause = exc.__cause__ if isinstance(exc, UserCodeFailed) else exc
        if show and cause is not None:
            traceback.print_exception(cause, file=sys.stderr)
        if isinstance(cause, RankError):
            head = "PlanError" if isinstance(cause, PlanError) else "error"
            print(f"{head}: {exc.args[0].split(' raised ')[0]} failed on the ranks: "
                  f"{_rank_line(cause)}", file=sys.stderr)
        elif isinstance(exc, PlanError):
            print(f"PlanError: {exc}", file=sys.stderr)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 1
