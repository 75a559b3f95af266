"""A property-based test of tplab.cost's public functions, like the lab's (test_arguments.py):
one argument of a valid call replaced by anything; either the call still works and gives
finite, non-negative numbers, or it raises a TypeError or ValueError that names the
argument, from tplab.cost's own checks (never a ZeroDivisionError, AttributeError or nan)."""

from __future__ import annotations

import math
import traceback

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplab import cost

H100 = cost.HARDWARE["H100 SXM"]
SHAPE = cost.MODELS["Llama-3 8B"].with_(layers=2)
ROWS = cost.sweep(SHAPE, H100, (1, 2))
ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-5, 70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                     st.lists(st.integers(-2, 6), max_size=3), st.just(H100), st.just(SHAPE),
                     st.just("ring"), st.just("LL"), st.just(cost.LINKS["NVLink 4"]))

# name: (function, valid keyword arguments)
CALLS = {
    "collective_time": (cost.collective_time, dict(op="all_reduce", nbytes=2**20,
                                                   group_size=8, link=H100,
                                                   algorithm="ring", protocol="auto")),
    "collective_terms": (cost.collective_terms, dict(op="all_gather", nbytes=2**20,
                                                     group_size=4, link=H100)),
    "collective_plan": (cost.collective_plan, dict(op="reduce_scatter", nbytes=4096,
                                                   group_size=16, link=H100)),
    "records_time": (cost.records_time, dict(records=[{"op": "all_reduce", "bytes": 64,
                                                       "group_size": 2}], link=H100,
                                             algorithm="ring", rank=None)),
    "block_collectives": (cost.block_collectives, dict(shape=SHAPE, tp=4,
                                                       sequence_parallel=False)),
    "block_flops": (cost.block_flops, dict(shape=SHAPE, sublayers=("attention", "mlp"))),
    "step_time": (cost.step_time, dict(shape=SHAPE, tp=2, hw=H100, sequence_parallel=False,
                                       mfu=0.4, dp=2, zero=1, precision="mixed",
                                       recompute="none", overlap="none", micro_batches=2,
                                       norm="composite", gemm="shape")),
    "sweep": (cost.sweep, dict(shape=SHAPE, hw=H100, tps=(1, 2))),
    "best_tp": (cost.best_tp, dict(rows=ROWS, objective="throughput", memory_limit=80e9)),
    "mlp_comm_ratio": (cost.mlp_comm_ratio, dict(shape=SHAPE, tp=2, hw=H100, mfu=0.4)),
    "scaled": (cost.scaled, dict(shape=SHAPE, hidden=2048)),
    "activation_bytes": (cost.activation_bytes, dict(shape=SHAPE, tp=2,
                                                     sequence_parallel=True)),
    "gpu_memory": (cost.gpu_memory, dict(shape=SHAPE, tp=2, precision="mixed", dp=2, zero=1)),
    "param_count": (cost.param_count, dict(shape=SHAPE, tp=2)),
    "gemm_efficiency": (cost.gemm_efficiency, dict(m=512, n=512, k=512, hw=H100)),
    "dp_collectives": (cost.dp_collectives, dict(shape=SHAPE, tp=2, dp=4, zero=3)),
    "dp_times": (cost.dp_times, dict(shape=SHAPE, tp=2, hw=H100, dp=4, micro_batches=2)),
    "tp_allowed": (cost.tp_allowed, dict(shape=SHAPE, tp=3)),
    "BlockShape": (cost.BlockShape, dict(hidden=64, heads=4, seq=8, batch=1, layers=1)),
    "Link": (cost.Link, dict(name="x", bandwidth=1e9, latency=1e-6)),
}
CASES = [(name, arg) for name, (_, kw) in CALLS.items() for arg in kw]


def check_result(value) -> None:
    numbers = [value] if isinstance(value, int | float) else []
    if isinstance(value, tuple):
        numbers = [v for v in value if isinstance(v, int | float)]
    if isinstance(value, dict):
        numbers = [v for v in value.values() if isinstance(v, int | float)]
    for v in numbers:
        assert math.isfinite(v) and v >= 0, value


@pytest.mark.parametrize("name, arg", CASES)
@settings(max_examples=12, deadline=None)
@given(value=ANYTHING)
def test_every_bad_cost_input_names_its_argument(name, arg, value):
    fn, kw = CALLS[name]
    try:
        got = fn(**{**kw, arg: value})
    except (TypeError, ValueError) as exc:
        # the argument (or, for a shape or a link, the field inside it) is named
        fields = {"shape": ("shape", "hidden", "heads", "tp"), "hw": ("hw", "link"),
                  "link": ("link", "group_size"), "rows": ("rows",),
                  "records": ("records",)}.get(arg, (arg,))
        assert any(f in str(exc) for f in fields), f"{arg}={value!r}: {exc}"
        frame = traceback.extract_tb(exc.__traceback__)[-1].filename
        assert "tplab/cost/" in frame.replace("\\", "/"), frame
    except BaseException as exc:  # noqa: BLE001 - what is raised is what is checked
        raise AssertionError(f"{name}({arg}={value!r}) raised {type(exc).__name__}: {exc}") \
            from exc
    else:
        check_result(got)


def test_the_issue_cases():
    """#22 item 8, one by one."""
    for call, names in [
            (lambda: cost.step_time(SHAPE, 0, H100), "tp"),
            (lambda: cost.sweep(SHAPE, H100, (0, 1)), "tps"),
            (lambda: cost.collective_time("all_reduce", -1e6, 8, H100), "nbytes"),
            (lambda: cost.collective_time("all_reduce", math.nan, 8, H100), "nbytes"),
            (lambda: cost.collective_time("all_reduce", 1, 0, H100), "group_size"),
            (lambda: cost.collective_time("all_reduce", 1, -4, H100), "group_size"),
            (lambda: cost.best_tp([]), "rows"),
            (lambda: cost.best_tp([], memory_limit=1e9), "rows"),
            (lambda: cost.best_tp(ROWS, memory_limit=math.nan), "memory_limit"),
            (lambda: cost.step_time(SHAPE, 2, "H100 SXM"), "hw"),
            (lambda: cost.step_time("Llama-3 8B", 2, H100), "shape"),
            (lambda: cost.BlockShape(hidden=4096, heads=0), "heads"),
            (lambda: cost.BlockShape(hidden=-4096, heads=32), "hidden"),
            (lambda: cost.mlp_comm_ratio(SHAPE, 2, H100, mfu=0), "mfu")]:
        with pytest.raises((TypeError, ValueError), match=names):
            call()
