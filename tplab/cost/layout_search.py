"""The layout search over `TrainingRun`s: every valid (TP, PP, CP, VPP, micro-batch,
sharding, recomputation) layout of a model on a number of GPUs, predicted for a stack
(`layouts`), and the fastest that fits in memory (`best_layout`). Each candidate is a
`tplab.cost.training_run.TrainingRun` priced by its `predict`; an argument no layout could
take is an error that names it (`check_grid`), never an empty answer."""

from __future__ import annotations

import difflib

from tplab.cost.hardware import HARDWARE, Hardware
from tplab.cost.shapes import MODELS, BlockShape
from tplab.cost.stacks import DEFAULT_STACK, get_stack
from tplab.cost.training_run import (
    PRECISIONS,
    RECOMPUTES,
    SHARDINGS,
    Prediction,
    TrainingRun,
    predict,
)
from tplab.cost.transformer import allowed_tps, tp_allowed
from tplab.cost.validate import check_choice, check_choices, check_degrees, check_int, check_type


def _named(kind: str, value, table: dict, table_name: str):
    """The entry `value` names in `table`, or a ValueError with the closest names."""
    if not isinstance(value, str):
        return value
    if value not in table:
        close = difflib.get_close_matches(value, list(table), n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
                f"have {', '.join(table)}")
        raise ValueError(f"{kind} = {value!r} is not in cost.{table_name}: {hint}")
    return table[value]


def check_grid(model, hardware, gpus, global_batch, seq_len, tps, pps, cps, vpps,
               micro_batches, shardings, recomputes, precision) -> tuple:
    """`layouts`' arguments, checked once: an error here would hold for every candidate
    layout, so it is raised naming the argument (not answered "no layout fits"). Returns
    the shape and the TP degrees to try (`tps=None`: those of 1-16 the heads allow)."""
    shape = _named("model", model, MODELS, "MODELS")
    check_type("model", shape, BlockShape, "a cost.MODELS name or a BlockShape")
    hw = _named("hardware", hardware, HARDWARE, "HARDWARE")
    check_type("hardware", hw, Hardware, "a cost.HARDWARE name or a Hardware")
    check_int("gpus", gpus)
    check_int("global_batch", global_batch)
    if seq_len is not None:
        check_int("seq_len", seq_len)
    check_choice("precision", precision, PRECISIONS)
    if precision == "fp8" and not hw.fp8_flops:
        raise ValueError(f"precision = 'fp8' needs fp8 Tensor Cores; hardware {hw.name} has "
                         "none (Hardware.fp8_flops = 0)")
    if tps is None:
        tps = allowed_tps(shape, (1, 2, 4, 8, 16))
    tps = check_degrees("tps", tps)
    refused = [t for t in tps if tp_allowed(shape, t)]
    if refused:
        raise ValueError(f"tps = {tps}: tp = {refused[0]} is not a TP degree "
                         f"{shape.name or 'this model'} allows: "
                         f"{tp_allowed(shape, refused[0])} (cost.allowed_tps keeps those it "
                         "does)")
    for name, value in (("pps", pps), ("cps", cps), ("vpps", vpps),
                        ("micro_batches", micro_batches)):
        check_degrees(name, value)
    check_choices("shardings", shardings, SHARDINGS)
    check_choices("recomputes", recomputes, RECOMPUTES)
    return shape, tps


def layouts(model, hardware, gpus: int, global_batch: int, seq_len: int | None = None,
            tps=None, pps=(1, 2, 4, 8, 16), cps=(1, 2), vpps=(1, 2, 4),
            micro_batches=(1, 2), shardings=SHARDINGS, recomputes=("none", "selective", "full"),
            precision: str = "bf16", stack: str = DEFAULT_STACK) -> list[Prediction]:
    """Every valid layout of `model` on `gpus` GPUs among the degrees given, predicted for
    `stack` (a `cost.STACKS` name); the invalid ones (a ValueError naming their rule) are
    left out. An argument no layout could take (`check_grid`, an unknown stack), or a grid
    with no valid layout at all, is a ValueError or TypeError naming why; `[]` never stands
    for a typo. `tps=None`: the degrees of 1-16 the model's heads allow."""
    get_stack(stack)                 # an unknown stack is an error, not an empty list
    _, tps = check_grid(model, hardware, gpus, global_batch, seq_len, tps, pps, cps, vpps,
                        micro_batches, shardings, recomputes, precision)
    out, refusals = [], []
    for tp in tps:
        for pp in pps:
            for cp in cps:
                for vpp in (vpps if pp > 1 else (1,)):
                    for mb in micro_batches:
                        for sharding in shardings:
                            for recompute in recomputes:
                                try:
                                    run = TrainingRun(model, hardware, gpus, tp=tp, pp=pp,
                                                      vpp=vpp, cp=cp, micro_batch=mb,
                                                      global_batch=global_batch,
                                                      seq_len=seq_len, precision=precision,
                                                      recompute=recompute, sharding=sharding,
                                                      stack=stack)
                                except ValueError as e:
                                    refusals.append(str(e))
                                    continue
                                out.append(predict(run))
    if not out:
        why = "; ".join(dict.fromkeys(refusals))
        raise ValueError(f"no layout of these degrees is valid on gpus = {gpus} with "
                         f"global_batch = {global_batch}: {why:.600}")
    return out


def best_layout(model, hardware, gpus: int, global_batch: int, **kw) -> Prediction | None:
    """The layout that fits in memory and trains the most tokens per second per GPU (ties
    to the smaller TP, then PP); None only if no valid layout fits in memory (a bad argument
    is an error, see `layouts`). `best_tp` is its special case with
    pp = cp = 1 and one sharding. Keywords as `layouts`."""
    fitting = [p for p in layouts(model, hardware, gpus, global_batch, **kw) if p.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (-p.tokens_per_s_per_gpu, p.run.tp, p.run.pp))
