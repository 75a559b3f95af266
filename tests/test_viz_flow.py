"""tplab.viz.grad_flow: where each collective sits on the model's data flow, on synthetic
traces (docs/CONTRACTS.md) and on real ones from tplab.simulate(4), DTensor plans and
Megatron by hand, with attention's q, k, v and SwiGLU's w1, w3 as parallel branches."""

from __future__ import annotations

import pytest
import torch
from test_viz import megatron_mlp, rec

import tplab
from tplab import models
from tplab.rank.explore_step import Settings, explore_step
from tplab.viz import forward_stages, grad_flow
from tplab.viz.flow import ROW_Y, module_order, side
from tplab.widgets import forward_order

CFG = models.Config()
MODELS = {"mlp": models.MLP, "attention": models.Attention, "block": models.Block}


def markers(fig):
    return [m for t in fig.data if t.name not in ("modules",) and isinstance(t.meta, (list, tuple))
            for m in t.meta if isinstance(m, dict)]


def points(fig, role=None):
    """(meta, x, y) of each marker, of one role ("f", "g") if given."""
    return [(m, x, y) for t in fig.data if t.name != "modules" and isinstance(t.meta, tuple)
            for m, x, y in zip(t.meta, t.x, t.y, strict=True) if role in (None, m["role"])]


def boxes(fig):
    """module -> (x, y) of its box's centre."""
    t = next(t for t in fig.data if t.name == "modules")
    return {m: (x, y) for m, x, y in zip(t.meta, t.x, t.y, strict=True)}


def stages(kind):
    return forward_stages(MODELS[kind](CFG), models.make_input(CFG))


# --- synthetic traces --------------------------------------------------------------------------

def test_grad_flow_puts_f_and_g_on_their_edges():
    fig = grad_flow(megatron_mlp(), ["mlp.w1", "mlp.act", "mlp.w2"])
    nodes = next(t for t in fig.data if t.name == "modules")
    assert list(nodes.meta) == ["input", "mlp.w1", "mlp.act", "mlp.w2", "loss"]
    assert "act" in nodes.text  # a module without collectives is still drawn
    got = {(m["phase"], m["edge"], m["role"]) for m in markers(fig)}
    # edge k joins node k and k+1: g on the forward edge out of w2 (node 3), f on the
    # backward edge into w1 (node 1)
    assert got == {("forward", 3, "g"), ("backward", 0, "f")}
    g = next(t for t in fig.data if t.name == "forward all-reduce")
    f = next(t for t in fig.data if t.name == "backward all-reduce")
    assert g.x[0] == 3.5 and g.y[0] > 0 and f.x[0] == 0.5 and f.y[0] < 0
    assert "f" in fig.layout.annotations[-1].text and "g" in fig.layout.annotations[-1].text


def test_grad_flow_sequence_parallel_gathers_and_stacking():
    trace = [rec(0, 0, "forward", "w1", "all_gather"),
             rec(0, 1, "forward", "w2", "reduce_scatter"),
             rec(0, 2, "backward", "w2", "all_gather"),
             rec(0, 3, "backward", "w1", "reduce_scatter"),
             rec(0, 4, "backward", "w1", "all_reduce")]
    fig = grad_flow(trace, ["w1", "w2"])
    where = {(m["phase"], m["op"]): (m["edge"], m["side"]) for m in markers(fig)}
    assert where == {("forward", "all_gather"): (0, "input"),
                     ("forward", "reduce_scatter"): (2, "output"),
                     ("backward", "all_gather"): (2, "output"),
                     ("backward", "reduce_scatter"): (0, "input"),
                     ("backward", "all_reduce"): (0, "input")}
    ys = [t.y[0] for t in fig.data if t.name in ("backward reduce-scatter", "backward all-reduce")]
    assert len(set(ys)) == 2 and all(y < 0 for y in ys)  # two on one edge: stacked
    assert side({"op": "all_reduce", "phase": "forward", "edge": "input"}) == "input"


def test_grad_flow_rank_choice_inferred_order_and_strays():
    trace = megatron_mlp()
    trace[1][1]["module"] = "head"  # rank 1's backward all-reduce in an unlisted module
    fig = grad_flow(trace, ["mlp.w1", "mlp.w2"], rank=1)
    nodes = list(next(t for t in fig.data if t.name == "modules").meta)
    assert nodes == ["input", "mlp.w1", "mlp.w2", "(outside the modules)", "loss"]
    assert "rank 1" in fig.layout.title.text
    # f only shows in the backward pass, yet its module goes first
    assert module_order(megatron_mlp()[0]) == ["mlp.w1", "mlp.w2"]
    parent = grad_flow([rec(0, 0, "backward", "mlp", "all_reduce")], ["mlp.w1", "mlp.w2"])
    assert [m["edge"] for m in markers(parent)] == [0]  # input edge of the first child
    # a hook on the whole model (module "") sits on the edges of the first and last modules
    root = grad_flow([rec(0, 0, "backward", "", "all_reduce"),
                      rec(0, 1, "forward", "", "all_reduce")], ["w1", "w2"])
    assert sorted(m["edge"] for m in markers(root)) == [0, 2]
    with pytest.raises(ValueError, match="rank 7"):
        grad_flow(megatron_mlp(), rank=7)



def test_grad_flow_orders_whole_model_hooks_by_the_trace():
    # A standalone block under sequence parallelism (tplab.megatron): split at the input, a
    # gather at the output, both by hooks on the whole model (module ""), around the layers'
    # own collectives.
    t = [rec(0, 0, "forward", "attention", "all_gather"),
         rec(0, 1, "forward", "attention.wo", "reduce_scatter"),
         rec(0, 2, "forward", "", "all_gather"),
         rec(0, 3, "backward", "attention.wo", "all_gather"),
         rec(0, 4, "backward", "attention", "reduce_scatter"),
         rec(0, 5, "backward", "", "all_gather")]  # last in backward: the input's split
    fig = grad_flow(t, ["attention.wq", "attention.wo"])
    got = sorted((m["phase"], m["module"], m["edge"]) for m in markers(fig))
    assert got == [("backward", "", 0), ("backward", "attention", 0),
                   ("backward", "attention.wo", 2), ("forward", "", 2),
                   ("forward", "attention", 0), ("forward", "attention.wo", 2)]
    weight = grad_flow([rec(0, 0, "backward", "ffn_norm", "all_reduce", shape=(32,))],
                       ["ffn_norm", "w1"])
    assert [m["role"] for m in markers(weight)] == ["dW"]  # a norm's weight grad is not f



def test_siblings_from_the_trace_and_given_by_the_caller():
    # f on each of two modules under one parent, nothing on their outputs: they read the
    # same input, one column of two branches
    two = [rec(0, 0, "forward", "ff.w2", "all_reduce"), rec(0, 1, "backward", "ff.w3",
                                                             "all_reduce"),
           rec(0, 2, "backward", "ff.w1", "all_reduce")]
    fig = grad_flow(two, ["ff.w1", "ff.w3", "ff.w2"])
    pos = boxes(fig)
    assert pos["ff.w1"][0] == pos["ff.w3"][0] == 1 and pos["ff.w2"][0] == 2
    assert pos["ff.w1"][1] > 0 > pos["ff.w3"][1]  # stacked, in forward order from the top
    assert sorted((m["branch"], m["edge"]) for m, *_ in points(fig, "f")) == [
        ("ff.w1", 0), ("ff.w3", 0)]
    # not siblings: under two parents; or ops that differ; or the first reduces its output
    moved = [{**r, "module": r["module"].replace("ff.w3", "xx.w3")} for r in two]
    for trace, names in ((moved, ["ff.w1", "xx.w3", "ff.w2"]),
                         ([*two[:2], {**two[2], "op": "all_gather"}], ["ff.w1", "ff.w3", "ff.w2"]),
                         ([*two, rec(0, 3, "forward", "ff.w1", "all_reduce")],
                          ["ff.w1", "ff.w3", "ff.w2"])):
        xs = [x for x, _ in boxes(grad_flow(trace, names)).values()]
        assert xs == [0, 1, 2, 3, 4]  # input, three columns, loss
    # the caller's groups win over the trace: wq, wk, wv without a collective of their own
    given = grad_flow([rec(0, 0, "backward", "", "all_reduce")], [("wq", "wk", "wv"), "wo"])
    assert [x for x, _ in boxes(given).values()] == [0, 1, 1, 1, 2, 3]
    assert [(m["edge"], m["branch"]) for m in markers(given)] == [(0, None)]


# --- real traces from tplab.simulate -----------------------------------------------------------

def traced_step(kind, path, cfg, sequence_parallel=False):
    """Rank side: one traced forward and backward of a model, TP over the whole world."""
    from torch.distributed.tensor import DTensor

    from tplab import megatron, plans

    model = MODELS[kind](cfg)
    mesh = tplab.make_mesh(tp=torch.distributed.get_world_size())
    if path == "megatron":
        model = megatron.parallelize(model, mesh, sequence_parallel=sequence_parallel)
    else:
        plan = {"attention": plans.attention(), "block": plans.block(sequence_parallel)}[kind]
        model = tplab.apply_plan(model, mesh, plan)
    x = models.make_input(cfg).requires_grad_(True)  # so that f has a dL/dx to sum
    with tplab.trace() as t:
        out = model(x)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        (0.5 * out.pow(2).sum()).backward()
    return t.records


@pytest.fixture(scope="module")
def real():
    """Rank 0's trace of each (model, path, sequence parallel) on tplab.simulate(4)."""
    sim = tplab.simulate(4)
    runs = [("attention", "dtensor", False), ("attention", "megatron", False),
            ("block", "dtensor", False), ("block", "megatron", False)]
    out = {run: sim.run(traced_step, run[0], run[1], CFG, run[2])[0] for run in runs}
    # the Explorer's attention under sequence parallelism: each of q, k, v gathers its input
    model = models.Attention(CFG)
    settings = Settings(model="attention", tp=4, path="dtensor", sequence_parallel=True)
    steps = sim.run(explore_step, "attention", CFG, model.state_dict(), models.make_input(CFG),
                    settings)
    out[("attention", "dtensor", True)] = steps[0].records
    return out


def test_forward_stages_groups_the_modules_that_read_one_input():
    assert stages("attention") == [("wq", "wk", "wv"), "wo"]
    assert stages("mlp") == ["w1", "w2"]
    block = stages("block")
    assert block == ["attention_norm", ("attention.wq", "attention.wk", "attention.wv"),
                     "attention.wo", "ffn_norm", ("feed_forward.w1", "feed_forward.w3"),
                     "feed_forward.w2"]
    flat = [n for s in block for n in ((s,) if isinstance(s, str) else s)]
    assert flat == forward_order(models.Block(CFG), models.make_input(CFG))


def test_grad_flow_dtensor_attention_has_an_f_on_each_branch(real):
    trace = real[("attention", "dtensor", False)]
    fig = grad_flow(trace, stages("attention"))
    pos = boxes(fig)
    assert pos["wq"][0] == pos["wk"][0] == pos["wv"][0] == 1 and pos["wo"][0] == 2
    assert pos["wq"][1] > pos["wk"][1] == 0 > pos["wv"][1]
    fs = points(fig, "f")
    assert sorted(m["branch"] for m, *_ in fs) == ["wk", "wq", "wv"]  # three all-reduces
    for m, x, y in fs:  # each on its own branch's backward edge, after the fan-out
        assert m["module"] == m["branch"] and m["edge"] == 0 and m["phase"] == "backward"
        assert 0.6 < x < 1 and y == pytest.approx(pos[m["branch"]][1] - ROW_Y)
    ((g, x, y),) = points(fig, "g")
    assert (g["edge"], g["branch"], x, y) == (2, None, 2.5, ROW_Y)
    # the fans: into three branches and out of them, forward and backward
    assert len([s for s in fig.layout.shapes if s.type == "path"]) == 2 * (3 + 3)
    assert "f</b> on each branch" in fig.layout.annotations[-1].text
    # from the trace alone (three f's of one shape under one parent), the same picture
    for modules in (["wq", "wk", "wv", "wo"], None):
        plain = grad_flow(trace, modules)
        assert boxes(plain) == pos and points(plain) == points(fig)
    assert module_order(trace) == ["wq", "wk", "wv", "wo"]


def test_grad_flow_megatron_attention_has_one_f_on_the_shared_edge(real):
    trace = real[("attention", "megatron", False)]
    fig = grad_flow(trace, stages("attention"))
    ((f, x, y),) = points(fig, "f")  # one all-reduce, by a hook on the whole attention
    assert (f["module"], f["edge"], f["branch"]) == ("", 0, None)
    assert x < 0.4 and y == -ROW_Y  # on the shared edge, before it fans out into q, k, v
    assert boxes(fig) == boxes(grad_flow(real[("attention", "dtensor", False)],
                                         stages("attention")))
    # a hook on a parent says nothing about the branches: from the trace alone, a chain
    plain = boxes(grad_flow(trace, ["wq", "wk", "wv", "wo"]))
    assert [plain[n][0] for n in ("wq", "wk", "wv", "wo")] == [1, 2, 3, 4]


def test_grad_flow_sequence_parallel_gathers_on_each_branch(real):
    fig = grad_flow(real[("attention", "dtensor", True)], stages("attention"))
    pos = boxes(fig)
    per_branch = {(m["branch"], m["phase"], m["op"]): y for m, _, y in points(fig)
                  if m["branch"]}
    for n in ("wq", "wk", "wv"):  # each gathers its input, and scatters dL/dx back
        assert per_branch[(n, "forward", "all_gather")] == pytest.approx(pos[n][1] + ROW_Y)
        assert per_branch[(n, "backward", "reduce_scatter")] == pytest.approx(pos[n][1] - ROW_Y)
    assert len(per_branch) == 6


def test_grad_flow_block_branches_both_ways(real):
    block = stages("block")
    dt = grad_flow(real[("block", "dtensor", False)], block)
    assert sorted(m["branch"] for m, *_ in points(dt, "f")) == [
        "attention.wk", "attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w3"]
    assert sorted(m["edge"] for m, *_ in points(dt, "g")) == [3, 6]  # out of wo and w2
    mg = grad_flow(real[("block", "megatron", False)], block)
    fs = sorted((m["edge"], m["module"], m["branch"]) for m, *_ in points(mg, "f"))
    assert fs == [(1, "attention", None), (4, "feed_forward", None)]  # one per shared input
    assert boxes(mg) == boxes(dt)
    names = forward_order(models.Block(CFG), models.make_input(CFG))
    assert boxes(grad_flow(real[("block", "dtensor", False)], names)) == boxes(dt)
