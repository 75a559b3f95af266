"""Notebook side of the exercises: run an answer on the lab's ranks (tplab/rank/exercise_steps.py)
and compare with the single-device reference computed here. Each checker raises `Stop` with
the first thing that is wrong, named with the rank where it shows, or returns what passed.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

import tplab
from tplab import models
from tplab.core.answers.solutions import BLOCK_SP_PLAN, MLP_PLAN
from tplab.exercises.feedback import close, fail, fmt_counts, max_diff, run_on_ranks, shape, spread
from tplab.rank import exercise_steps as steps


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def need_function(name: str, answer) -> None:
    if not (inspect.isclass(answer) and issubclass(answer, torch.autograd.Function)):
        raise fail(name, f"the answer must be a torch.autograd.Function subclass (a class with "
                         f"static forward(ctx, x, group) and backward(ctx, grad)), not "
                         f"{type(answer).__name__} {answer!r}")


def need_module(name: str, answer) -> None:
    if not (inspect.isclass(answer) and issubclass(answer, torch.nn.Module)):
        raise fail(name, f"the answer must be an nn.Module class built as Answer(linear, mesh), "
                         f"not {type(answer).__name__} {answer!r}")


def _first_bad(values, expected, atol=1e-4):
    """(rank, max difference) of the first rank whose tensor is not `expected[rank]`."""
    for r, v in enumerate(values):
        if not close(v, expected[r], atol):
            return r, (max_diff(v, expected[r]) if shape(v) == shape(expected[r]) else None)
    return None


def _common(name, res, what: str, op: str):
    for r, out in enumerate(res):
        if not out.get("requires_grad", True):
            raise fail(name, f"on rank {r} the output of {what} does not require grad: return a "
                             "tensor computed from x (e.g. x.view_as(x)), not a detached one")
        edited = float(out.get("input_edited", 0))
        if edited > 0:
            raise fail(name, f"on rank {r} your forward changed its input x in place (by up to "
                             f"{edited:.3g}): the caller's tensor must stay as it "
                             f"was; {op} into a copy (x.clone())")


def _no_grad(name, res, what):
    for r, out in enumerate(res):
        if out["dx"] is None:
            raise fail(name, f"on rank {r} your backward returned None for x: return "
                             f"({what}, None), one gradient per input of forward")


def _in_place(name, res):
    for r, out in enumerate(res):
        edited = float(out.get("grad_edited", 0))
        if edited > 0:
            raise fail(name, f"on rank {r} your backward changed the incoming gradient in place "
                             f"(by up to {edited:.3g}; dist.all_reduce(grad) writes "
                             "into it): autograd may pass that tensor to other consumers too. "
                             "Reduce a copy: grad = grad.clone() first")


def check_f(name, Answer, lab):
    need_function(name, Answer)
    n = lab.world_size
    x = torch.randn(2, 3, 4, generator=_gen(0))
    w = torch.randn(n, 2, 3, 4, generator=_gen(1))
    res = run_on_ranks(name, lab, steps.conjugate_step, Answer, x, w, False)
    _common(name, res, "Answer.apply(x, group)", "reduce")
    fwd = res[0]["counts"].get("forward", {})
    if fwd:
        raise fail(name, f"your forward issues {fmt_counts(fwd)} on every rank: f's forward is "
                         "the identity (every rank already holds the whole x); the all-reduce "
                         "belongs in its backward. An all-reduce forward is g, not f")
    bad = _first_bad([o["y"] for o in res], [x] * n)
    if bad:
        r, d = bad
        got = shape(res[r]["y"])
        raise fail(name, f"on rank {r} your forward returns " + (
            f"shape {got} for x of shape {shape(x)}" if d is None else
            f"a tensor that differs from x by up to {d:.3g}") + ": f's forward is the identity")
    _no_grad(name, res, "dL/dx")
    total = w.sum(0)
    dxs = [o["dx"] for o in res]
    if all(close(dxs[r], w[r]) for r in range(n)) and n > 1:
        raise fail(name, f"your backward returns each rank's own term: dL/dx differs across "
                         f"ranks by up to {spread(dxs):.3g}; f's backward must sum the terms "
                         "over the ranks (dist.all_reduce)")
    bad = _first_bad(dxs, [total] * n)
    if bad:
        r, d = bad
        raise fail(name, f"on rank {r} dL/dx differs from the sum over ranks by up to {d:.3g}"
                   + (f" (dL/dx differs across ranks by up to {spread(dxs):.3g})"
                      if spread(dxs) > 1e-5 else ""))
    _in_place(name, res)
    bwd = res[0]["counts"].get("backward", {})
    if bwd != {"all_reduce": 1} and n > 1:
        raise fail(name, f"your backward issues {fmt_counts(bwd)}: f needs exactly one "
                         "all_reduce there")
    return (f"forward: the identity on every rank; backward: one all_reduce, dL/dx the sum "
            f"of the {n} ranks' terms on every rank")


def check_g(name, Answer, lab):
    need_function(name, Answer)
    n = lab.world_size
    parts = torch.randn(n, 2, 3, 4, generator=_gen(2))
    w = torch.randn(2, 3, 4, generator=_gen(3)).expand(n, 2, 3, 4).contiguous()
    res = run_on_ranks(name, lab, steps.conjugate_step, Answer, parts, w, True)
    _common(name, res, "Answer.apply(x, group)", "sum")
    total = parts.sum(0)
    ys = [o["y"] for o in res]
    if n > 1 and all(close(ys[r], parts[r]) for r in range(n)):
        raise fail(name, f"your forward returns this rank's partial: y differs across ranks by "
                         f"up to {spread(ys):.3g}; g's forward sums the partials over the ranks "
                         "(dist.all_reduce)")
    bad = _first_bad(ys, [total] * n)
    if bad:
        r, d = bad
        raise fail(name, f"on rank {r} y " + (f"has shape {shape(ys[r])}, not {shape(total)}"
                                              if d is None else
                                              f"differs from the sum of the partials by up to "
                                              f"{d:.3g}"))
    _no_grad(name, res, "dL/dy")
    dxs = [o["dx"] for o in res]
    if n > 1 and all(close(dxs[r], n * w[r]) for r in range(n)):
        raise fail(name, f"your backward all-reduces: dL/dx_r is {n} times too large on every "
                         "rank. y = sum_r x_r, so dL/dx_r = dL/dy, which every rank already "
                         "holds: g's backward is the identity")
    bad = _first_bad(dxs, w)
    if bad:
        r, d = bad
        raise fail(name, f"on rank {r} dL/dx_r differs from dL/dy by up to {d:.3g}: g's "
                         "backward is the identity")
    bwd, fwd = res[0]["counts"].get("backward", {}), res[0]["counts"].get("forward", {})
    if bwd:
        raise fail(name, f"your backward issues {fmt_counts(bwd)}: g's backward needs none")
    if fwd != {"all_reduce": 1} and n > 1:
        raise fail(name, f"your forward issues {fmt_counts(fwd)}: g needs one all_reduce")
    return f"forward: one all_reduce, y the sum of {n} partials; backward: the identity"


def _linear(seed: int, din: int, dout: int) -> torch.nn.Linear:
    return models.init_weights(torch.nn.Linear(din, dout), seed=seed)


def _param(name, res, r, pname, expected_shape):
    p = res[r]["params"].get(pname)
    if p is None:
        raise fail(name, f"your module has no parameter `{pname}` (it has "
                         f"{sorted(res[r]['params'])}): keep this rank's shard as "
                         f"self.{pname} = nn.Parameter(...)")
    if shape(p) != expected_shape:
        raise fail(name, f"on rank {r} self.{pname} has shape {shape(p)}; this rank's shard "
                         f"is {expected_shape}")


def check_column(name, Answer, lab):
    need_module(name, Answer)
    n, din, dout = lab.world_size, 8, 4 * lab.world_size
    linear, x = _linear(10, din, dout), torch.randn(2, 3, din, generator=_gen(4))
    res = run_on_ranks(name, lab, steps.linear_step, Answer, linear, x, False)
    x_ref = x.clone().requires_grad_()
    y_ref = linear(x_ref)
    (0.5 * y_ref.pow(2).sum()).backward()
    rows = dout // n
    for r, out in enumerate(res):
        _param(name, res, r, "weight", (rows, din))
        _param(name, res, r, "bias", (rows,))
        want = y_ref.detach()[..., r * rows:(r + 1) * rows]
        if shape(out["y"]) != shape(want):
            raise fail(name, f"on rank {r} your output has shape {shape(out['y'])}; a column-"
                             f"parallel linear keeps this rank's out/N = {rows} features: "
                             f"{shape(want)} (gather nothing: the next layer is row-parallel)")
        if not close(out["y"], want):
            raise fail(name, f"on rank {r} your output differs from features "
                             f"[{r * rows}:{(r + 1) * rows}] of the full linear by up to "
                             f"{max_diff(out['y'], want):.3g}: keep rows "
                             f"[{r * rows}:{(r + 1) * rows}] of weight (out, in) and of bias")
    dxs = [o["dx"] for o in res]
    if dxs[0] is None:
        raise fail(name, "dL/dx is None: the input's gradient never reached x")
    if n > 1 and not close(dxs[0], x_ref.grad) and spread(dxs) > 1e-5:
        raise fail(name, f"dL/dx differs across ranks by up to {spread(dxs):.3g} (rank 0 is off "
                         f"by {max_diff(dxs[0], x_ref.grad):.3g}): each rank holds only its "
                         "own term; apply f to x first so the backward sums them")
    bad = _first_bad(dxs, [x_ref.grad] * n)
    if bad:
        raise fail(name, f"on rank {bad[0]} dL/dx differs from the reference by up to "
                         f"{bad[1]:.3g}")
    for r, out in enumerate(res):
        for pname, full, in (("weight", linear.weight.grad), ("bias", linear.bias.grad)):
            want = full[r * rows:(r + 1) * rows]
            if not close(out["grads"].get(pname), want):
                raise fail(name, f"on rank {r} the gradient of {pname} differs from its rows "
                                 f"of the reference gradient")
    return (f"every rank: its {rows} output features; dL/dx whole and equal on every rank "
            f"({fmt_counts(res[0]['counts'].get('backward', {}))} in the backward)")


def check_row(name, Answer, lab):
    need_module(name, Answer)
    n, dout, din = lab.world_size, 8, 4 * lab.world_size
    linear, x = _linear(11, din, dout), torch.randn(2, 3, din, generator=_gen(5))
    res = run_on_ranks(name, lab, steps.linear_step, Answer, linear, x, True)
    x_ref = x.clone().requires_grad_()
    y_ref = linear(x_ref)
    (0.5 * y_ref.pow(2).sum()).backward()
    cols = din // n
    for r, out in enumerate(res):
        _param(name, res, r, "weight", (dout, cols))
        y = out["y"]
        if shape(y) != shape(y_ref):
            raise fail(name, f"on rank {r} your output has shape {shape(y)}, not {shape(y_ref)}")
        off = (y - y_ref.detach())
        if n > 1 and close(off, (n - 1) * linear.bias.detach().expand_as(off)):
            raise fail(name, f"your output is off by {n - 1} x bias on every rank: each rank "
                             f"adds the bias before g sums the {n} partials; add it once, after "
                             "the sum")
        if not close(y, y_ref.detach()):
            ys = [o["y"] for o in res]
            why = (f"; the ranks disagree by up to {spread(ys):.3g}: each holds only its "
                   "partial sum, which g must add up") if spread(ys) > 1e-5 else ""
            raise fail(name, f"on rank {r} your output differs from the full linear's by up "
                             f"to {max_diff(y, y_ref):.3g}{why}")
    for r, out in enumerate(res):
        want = x_ref.grad[..., r * cols:(r + 1) * cols]
        if not close(out["dx"], want):
            raise fail(name, f"on rank {r} dL/dx_r differs from features "
                             f"[{r * cols}:{(r + 1) * cols}] of the reference dL/dx")
        if not close(out["grads"].get("weight"), linear.weight.grad[:, r * cols:(r + 1) * cols]):
            raise fail(name, f"on rank {r} the gradient of weight differs from its columns of "
                             "the reference gradient")
    return f"every rank: the whole y (one {fmt_counts(res[0]['counts'].get('forward', {}))})"


def check_sp_pair(name, answer, lab):
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise fail(name, "the answer is a pair (GatherSeq, ReduceScatterSeq) of "
                         f"torch.autograd.Function classes, not {answer!r}")
    for part in answer:
        need_function(name, part)
    n = lab.world_size
    x = torch.randn(2, 2 * n, 3, generator=_gen(6))
    wg = torch.randn(n, 2, 2 * n, 3, generator=_gen(7))
    p = torch.randn(n, 2, 2 * n, 3, generator=_gen(8))
    ws = torch.randn(n, 2, 2, 3, generator=_gen(9))
    res = run_on_ranks(name, lab, steps.sequence_step, *answer, x, wg, p, ws)
    chunk = lambda t, r: t[:, 2 * r:2 * r + 2]
    expect = {"gather": ([x] * n, [chunk(wg.sum(0), r) for r in range(n)],
                         {"forward": {"all_gather": 1}, "backward": {"reduce_scatter": 1}}),
              "scatter": ([chunk(p.sum(0), r) for r in range(n)],
                          [torch.cat(list(ws), dim=1)] * n,
                          {"forward": {"reduce_scatter": 1}, "backward": {"all_gather": 1}})}
    label = {"gather": "GatherSeq", "scatter": "ReduceScatterSeq"}
    for part, (ys, dxs, counts) in expect.items():
        outs = [o[part] for o in res]
        for direction, got, want in (("forward", "y", ys), ("backward", "dx", dxs)):
            bad = _first_bad([o[got] for o in outs], want)
            if bad:
                r, d = bad
                what = "output" if got == "y" else "input gradient"
                raise fail(name, f"{label[part]}'s {direction}: on rank {r} the {what} " + (
                    f"has shape {shape(outs[r][got]) if outs[r][got] is not None else None}, "
                    f"expected {shape(want[r])} (the sequence is dim 1)" if d is None else
                    f"differs from the reference by up to {d:.3g}"))
        _in_place(name, outs)
        if n > 1 and outs[0]["counts"] != counts:
            got = {ph: fmt_counts(c) for ph, c in outs[0]["counts"].items()}
            raise fail(name, f"{label[part]} is right but issues {got}; it needs "
                             f"{ {ph: fmt_counts(c) for ph, c in counts.items()} } (no all-reduce:"
                             " the point of SP is to move the same bytes in halves)")
    return ("GatherSeq: all-gather forward, reduce-scatter backward; ReduceScatterSeq: the "
            "reverse; both right on every rank")


# {lab: {key: plan_counts' answer}}: what a reference plan issues on a lab is the same for
# every answer checked there, so it is traced once per lab (a lab that is gone drops out)
_REFERENCE_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_counts(name, lab, build, reference_plan, make_x, key) -> dict:
    """`steps.plan_counts` of the reference plan on `lab`'s rank 0, traced at the first
    check that needs it. `key` names everything the answer depends on besides the lab (the
    model, its config, the reference plan); the lab's world size is part of it too."""
    known = _REFERENCE_COUNTS.setdefault(lab, {})
    key = (key, lab.world_size)
    if key not in known:
        known[key] = run_on_ranks(name, lab, steps.plan_counts, build, reference_plan,
                                  make_x)[0]
    return known[key]


def _plan_check(name, plan, lab, build, make_x, reference_plan, what):
    if not (isinstance(plan, dict) or callable(plan)):
        raise fail(name, f"a plan is a dict {{module path: ParallelStyle}}, not "
                         f"{type(plan).__name__}")
    try:
        report = tplab.grad_check(lab, build, plan, make_x)
    except tplab.PlanError as err:
        raise fail(name, f"your plan does not fit {what}: {err}") from None
    except tplab.CellTimeout:
        raise  # a plan function that computes forever: check() says so
    except (tplab.LabError, RuntimeError, ValueError, TypeError) as err:
        run_on_ranks(name, lab, steps.plan_counts, build, plan, make_x)  # names the ranks
        raise fail(name, f"your plan fails: {err}") from None
    if not report.ok:
        rows = [f"{row['name']} ({row['kind'].replace('_', ' ')}, off by up to "
                f"{row['max_abs']:.3g})" for row in report.failures
                if row["kind"] != "replica_spread"] or [
            f"{row['name']} (differs across ranks by up to {row['max_abs']:.3g})"
            for row in report.failures]
        hint = ""
        if any(row["name"].endswith("norm.weight") for row in report.failures):
            hint = ("; a norm that runs on this rank's sequence shard sees only its tokens: "
                    "under SP its weight's gradient must be summed over the ranks "
                    "(SequenceParallel() does that)")
        raise fail(name, f"your plan runs but computes wrong values: {', '.join(rows)}{hint}")
    got = run_on_ranks(name, lab, steps.plan_counts, build, plan, make_x)[0]
    want = reference_counts(name, lab, build, reference_plan, make_x,
                            (what, id(reference_plan), repr(build.func), repr(build.args),
                             repr(make_x.func), repr(make_x.args)))
    if got["counts"] != want["counts"]:
        g = {ph: fmt_counts(c) for ph, c in got["counts"].items()}
        w = {ph: fmt_counts(c) for ph, c in want["counts"].items()}
        sp = ("; an all_reduce forward means no sequence parallelism: under SP the "
              "rowwise layers reduce-scatter onto Shard(1) and the colwise ones all-gather"
              if "all_reduce" in got["counts"].get("forward", {})
              and "all_reduce" not in want["counts"].get("forward", {}) else "")
        raise fail(name, f"your plan computes the right values but issues {g}, where the "
                         f"reference plan issues {w}{sp}")
    return (f"{what}: outputs and every gradient match one device; collectives "
            f"{ {ph: fmt_counts(c) for ph, c in got['counts'].items()} }")


def exercise_config(lab) -> models.Config:
    return models.Config(dim=16, n_heads=lab.world_size, hidden_dim=8 * lab.world_size,
                         batch_size=2, seq_len=2 * lab.world_size)


def check_mlp_plan(name, plan, lab):
    cfg = exercise_config(lab)
    return _plan_check(name, plan, lab, functools.partial(models.MLP, cfg),
                       functools.partial(models.make_input, cfg), MLP_PLAN, "the MLP")


def check_block_plan(name, plan, lab):
    cfg = exercise_config(lab)
    return _plan_check(name, plan, lab, functools.partial(models.Block, cfg),
                       functools.partial(models.make_input, cfg), BLOCK_SP_PLAN,
                       "the block with sequence parallelism")
