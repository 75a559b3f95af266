"""`python -m tplab check MOD:build MOD:plan MOD:make_input --world-size N`: grad_check
from the command line, for a user's CI.

Each MOD:NAME names an object in an importable module (the current directory is on the
path, here and on the ranks). `build` and `make_input` take no arguments (as in
`tplab.grad_check`); `plan` is a dict, a function of no arguments that returns one
(`tplab.plans:mlp`), or a `(model, mesh) -> model` function. `--loss MOD:fn` is the
loss_fn. `--simulated` runs the ranks in this process (`tplab.simulate`).

`--train STEPS` checks a training run instead (`tplab.train_check`): the third name is then
`make_batch(i)` (one of no arguments gives the same batch every step), `--step MOD:fn` the
training step `step(model, optimizer, batch) -> loss` (default: forward, `--loss`,
backward, AdamW step).

Prints the report. Exit status: 0 when the check passes, 1 when it fails (a PlanError
included), 2 on bad arguments (a name that does not resolve, a bad world size).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys


class BadArgument(Exception):
    pass


def resolve(spec: str):
    """The object MOD:NAME (NAME may be dotted: MOD:Class.method)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadArgument(f"{spec!r} is not MODULE:NAME (e.g. mypkg.model:build)")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadArgument(f"cannot import {module_name!r} (from {spec!r}): {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise BadArgument(f"{module_name!r} has no {attr!r}; it has: "
                              f"{', '.join(names[:12])}")
        obj = getattr(obj, part)
    return obj


def _plan(obj):
    if isinstance(obj, dict) or not callable(obj):
        return obj
    try:
        required = [p for p in inspect.signature(obj).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return obj
    return obj() if not required else obj  # a plan factory, or (model, mesh) -> model


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tplab check",
        description="grad_check a tensor-parallel model against its single-device self")
    parser.add_argument("build", help="MOD:NAME of build_model()")
    parser.add_argument("plan", help="MOD:NAME of the plan (dict, factory or callable)")
    parser.add_argument("make_input", help="MOD:NAME of make_input()")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--loss", help="MOD:NAME of loss_fn(output[, input])")
    parser.add_argument("--simulated", action="store_true",
                        help="simulated ranks in this process (tplab.simulate)")
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--train", type=int, metavar="STEPS",
                        help="train_check STEPS training steps instead of one grad_check")
    parser.add_argument("--step", help="MOD:NAME of step(model, optimizer, batch) -> loss "
                                       "(with --train)")
    args = parser.parse_args(argv)  # exits 2 on a malformed command line
    if args.train is not None and args.train < 1:
        print("error: --train STEPS must be >= 1", file=sys.stderr)
        return 2
    if args.step and args.train is None:
        print("error: --step is for a training run: give --train STEPS too", file=sys.stderr)
        return 2
    if args.world_size < 1:
        print("error: --world-size must be >= 1", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())
    # the ranks import the same modules by name: give them this directory too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        build, make_input = resolve(args.build), resolve(args.make_input)
        plan = _plan(resolve(args.plan))
        loss = resolve(args.loss) if args.loss else None
        step = resolve(args.step) if args.step else None
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import tplab

    lab = (tplab.simulate(args.world_size) if args.simulated
           else tplab.launch(args.world_size))
    try:
        if args.train is not None:
            report = tplab.train_check(lab, build, plan, batches(make_input), args.train,
                                       step=step, loss_fn=None if step else loss, live=False)
        else:
            report = tplab.grad_check(lab, build, plan, make_input, loss, atol=args.atol,
                                      rtol=args.rtol)
    except tplab.PlanError as exc:
        print(f"PlanError: {exc}")
        return 1
    finally:
        lab.shutdown()
    print(report)
    return 0 if report.ok else 1
