"""tplab.checks.explorer.Explorer: driven from code (as a papermill run does) and through its
controls, on tplab.simulate; once on real rank processes (slow)."""

from __future__ import annotations

import warnings

import pytest

import tplab
from tplab.checks.explorer import Explorer
from tplab.widgets import divisors, forward_order

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's c10d deprecations


def counts(trace, rank=0):
    out: dict = {}
    for r in trace[rank]:
        out[(r["phase"], r["op"])] = out.get((r["phase"], r["op"]), 0) + 1
    return out


def blocks_of(fig, tensor):
    return [t.meta for t in fig.data if isinstance(t.meta, dict) and t.meta["tensor"] == tensor]


@pytest.fixture(scope="module")
def explorer():
    return Explorer(tplab.simulate(4))  # MLP, Megatron by hand, tp = 4


def test_explorer_runs_a_step_and_draws_it(explorer):
    ex = explorer.set(model="mlp", path="megatron", tp=4, drop_f=False)
    assert ex.report.ok, ex.report.summary()
    assert counts(ex.trace) == {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}
    assert len(ex.trace) == 4 and ex.error is None
    assert set(ex.figures) == {"flow", "timeline", "errors", "sharding"}
    flow = [m for t in ex.figures["flow"].data if t.name != "modules" and t.meta
            for m in t.meta]
    assert {(m["phase"], m["role"]) for m in flow} == {("forward", "g"), ("backward", "f")}
    w1 = blocks_of(ex.figures["sharding"], "w1.weight")
    assert [b["ranks"] for b in w1] == [[0], [1], [2], [3]]  # column-parallel: rows split
    assert [b["kind"] for b in blocks_of(ex.figures["sharding"], "w2.bias")] == ["replicated"]


def test_the_controls_rerun_the_step(explorer):
    ex = explorer.set(model="mlp", path="megatron", tp=4, drop_f=False)
    panel = ex.widget  # builds the panel
    ui = ex._ui
    assert ui["tp"].options == (2, 4) and ui["model"].value == "mlp"
    ui["drop_f"].value = True  # a click: f loses its backward all-reduce
    assert ex.settings.drop_f and not ex.report.ok
    wrong = {(r["name"], r["kind"]) for r in ex.report.failures}
    assert wrong == {("input", "input_grad"), ("input", "replica_spread")}  # weights fine
    assert counts(ex.trace) == {("forward", "all_reduce"): 1}
    bad = [m for t in ex.figures["errors"].data if isinstance(t.meta, tuple) for m in t.meta
           if m["status"] == "bad"]
    assert {m["kind"] for m in bad} == {"input_grad", "replica_spread"}
    assert "WRONG" in ui["status"].value and "replica_spread" in ui["table"].value
    with pytest.raises(ValueError, match="drop_f needs path='megatron'"):
        ex.set(path="dtensor")
    ui["path"].value = "dtensor"  # there, drop f is switched off and disabled
    assert ex.settings.path == "dtensor" and not ex.settings.drop_f
    assert ui["drop_f"].disabled and not ui["drop_f"].value and ex.report.ok
    assert panel is ex.widget


def test_dtensor_attention_and_a_tp_degree_below_the_world_size(explorer):
    ex = explorer.set(model="attention", path="dtensor", tp=4, drop_f=False)
    assert ex.report.ok
    # ColwiseParallel on q, k and v: one all-reduce each in the backward pass
    assert counts(ex.trace) == {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 3}
    ex.set(model="mlp", tp=2)  # a 2-D mesh dp=2 x tp=2
    assert ex.report.ok
    assert {(r["group"], r["group_size"]) for rs in ex.trace for r in rs} == {("tp", 2)}
    fig = ex.figures["sharding"]
    assert "dp=2 × tp=2" in fig.layout.title.text
    assert [b["ranks"] for b in blocks_of(fig, "w1.weight")] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="tp must divide"):
        ex.set(tp=3)


def test_helpers():
    from tplab import models

    cfg = models.Config()
    assert forward_order(models.Block(cfg), models.make_input(cfg)) == [
        "attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
        "ffn_norm", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]
    assert divisors(4) == [2, 4] and divisors(6) == [2, 3, 6] and divisors(1) == [1]


@pytest.mark.slow
def test_explorer_on_rank_processes(labs):
    ex = Explorer(labs.get(2), model="mlp")
    assert ex.report.ok, ex.report.summary()
    assert counts(ex.trace, 1) == {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}


def test_cost_explorer_prices_whole_runs_with_pp_cp_and_sharding():
    from tplab import cost
    from tplab.cost.explorer import CostExplorer

    ex = CostExplorer(model="Llama-3 70B", hw="H100 SXM")
    ex.update(pp=4, sharding="fsdp", gpus=512, global_batch=1024, seq=8192)
    ok = {tp: p for tp, p in ex.runs.items() if not isinstance(p, str)}
    assert ok and all(p.run.pp == 4 and p.run.sharding == "fsdp" for p in ok.values())
    want = cost.predict(cost.TrainingRun(ex.shape, ex.hw, 512, tp=8, pp=4, micro_batch=1,
                                         global_batch=1024, seq_len=8192, sharding="fsdp"))
    assert ok[8].tokens_per_s_per_gpu == want.tokens_per_s_per_gpu
    best = max((p for p in ok.values() if p.fits), key=lambda p: p.tokens_per_s_per_gpu)
    assert ex.run_tp == best.run.tp and f"TP {ex.run_tp}</b>" in ex.summary.value
    ex.update(cp=16, seq=4096, gpus=64)     # 64 GPUs: tp x pp x cp > 64 beyond TP 1
    assert all("tp x pp x cp" in ex.runs[tp] for tp in ex.runs if tp > 1)
