"""tplab.memory on the ranks and the memory model of tplab.cost: byte for byte on the lab's
MLP and Block (world 1, 2, 4, with and without SP, both plans; simulated and processes),
the paper's constants, and the per-GPU model at scale."""

from __future__ import annotations

import json
import pathlib

import pytest
import report

import tplab
from tplab import cost, models
from tplab.cost import BlockShape
from tplab.cost.lab_models import lab_memory
from tplab.cost.memory import gpt_layer, layer_saved, tplab_layer

CASES = [("mlp", "megatron", False), ("mlp", "megatron", True), ("mlp", "dtensor", False),
         ("block", "megatron", False), ("block", "megatron", True),
         ("block", "dtensor", False), ("block", "dtensor", True)]


def measured_steps(cases, cfg):
    """Rank side: one forward and backward of each case under tplab.memory, then an Adam
    step measured on the last model."""
    import torch

    import tplab
    from tplab import megatron, models, plans

    mesh = tplab.make_mesh(tp=torch.distributed.get_world_size())
    out = {}
    for kind, plan, sp in cases:
        model = (models.MLP if kind == "mlp" else models.Block)(cfg)
        if plan == "megatron":
            model = megatron.parallelize(model, mesh, sequence_parallel=sp)
        else:
            model = tplab.apply_plan(model, mesh, plans.mlp() if kind == "mlp" else
                                     plans.block(sp))
        x = models.make_input(cfg).requires_grad_()
        with tplab.memory() as m:
            model(x).sum().backward()
        out[(kind, plan, sp)] = m.summary()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    with tplab.memory(model, optimizer=opt) as m:
        pass
    out["adam"] = (m.optimizer_bytes, m.param_bytes, len(list(model.parameters())))
    return out


_CHECKED: dict[str, int] = {}   # "simulated 2" -> numbers compared, for the report


def check(per_rank, cfg, world_size, label):
    numbers = 0
    for case in CASES:
        predicted = lab_memory(case[0], cfg, world_size, case[2])
        for rank, result in enumerate(per_rank):
            assert result[case] == predicted, (case, rank)
            numbers += 5 + len(predicted["rows"])
    for rank, (optimizer, params, tensors) in enumerate(r["adam"] for r in per_rank):
        # Adam's exp_avg and exp_avg_sq, fp32 each, and one 4-byte step tensor per parameter
        assert optimizer == 2 * params + 4 * tensors, rank
    _CHECKED[f"{label} {world_size}"] = numbers


def teardown_module(module):
    if _CHECKED:
        report.LINES["memory"] = [
            f"memory model against tplab.memory: 0 bytes off in {sum(_CHECKED.values())} "
            f"numbers (world sizes: {', '.join(sorted(_CHECKED))})"]


# Simulated at 1 (nothing sharded: the model's baseline) and 2 prove the model against the
# measurement in a simulation; processes prove it again at 2 and 4 ranks on the session's
# labs. World 4 simulated, and 1 on processes (a lab started for it alone), repeat the claim
# at sizes already proved: the extended suite.
EXTENDED = pytest.mark.extended


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=EXTENDED)])
def test_model_equals_measured_bytes_simulated(world_size):
    cfg = models.Config()
    check(tplab.simulate(world_size).run(measured_steps, CASES, cfg), cfg, world_size,
          "simulated")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=EXTENDED), 2, 4])
def test_model_equals_measured_bytes_on_processes(labs, world_size):
    # batch 3: the all-gathered sequence is a strided view unless made contiguous
    cfg = models.Config(dim=48, hidden_dim=96, seq_len=12, batch_size=3)
    check(labs.get(world_size).run(measured_steps, CASES, cfg), cfg, world_size, "processes")


def test_sp_shards_the_norms_and_tp_the_regions():
    cfg = models.Config()
    one, four, four_sp = (lab_memory("block", cfg, t, sp) for t, sp in
                          ((1, False), (4, False), (4, True)))
    rows = {r["module"]: r["bytes"] for r in four["rows"]}
    rows_sp = {r["module"]: r["bytes"] for r in four_sp["rows"]}
    by_one = {r["module"]: r["bytes"] for r in one["rows"]}
    # TP alone leaves the norms whole on every rank; SP splits them 4 ways
    assert rows["attention_norm"] == by_one["attention_norm"] == 4 * rows_sp["attention_norm"]
    assert rows["attention"] * 4 == by_one["attention"] == rows_sp["attention"] * 4
    assert rows["attention.wq"] == rows_sp["attention.wq"] == by_one["attention.wq"]
    assert four_sp["activation_bytes"] < four["activation_bytes"] < one["activation_bytes"]


def test_memory_tracks_the_peak_and_distinct_storages():
    def steps():
        import torch

        import tplab

        lin = torch.nn.Linear(8, 8, bias=False)
        x = torch.randn(4, 8, requires_grad=True)
        with tplab.memory() as one:
            y = lin(x)
            (y * y).sum().backward()     # lin saves x; the mul saves y twice: one storage
        with tplab.memory() as two:
            for _ in range(2):           # backward frees the first step before the second
                y = lin(x)
                (y * y).sum().backward()
        with tplab.memory() as kept:
            y1, y2 = lin(x), lin(x)      # both steps alive at once
            ((y1 * y1).sum() + (y2 * y2).sum()).backward()
        return one.summary(), two.summary(), kept.summary()

    for run in (steps, lambda: tplab.simulate(2).run(steps)[1]):
        one, two, kept = run()
        assert one["activation_bytes"] == one["peak_bytes"] == 2 * 4 * 8 * 4
        assert one["rows"] == [{"module": "", "bytes": 256, "storages": 2}]
        assert one["param_bytes"] == one["grad_bytes"] == 8 * 8 * 4
        assert two["activation_bytes"] == 2 * one["activation_bytes"]
        assert two["peak_bytes"] == one["peak_bytes"]
        assert kept["peak_bytes"] == 3 * 4 * 8 * 4   # x once, y1 and y2


def nested_steps():
    """Rank side: the same step measured alone, inside two nested contexts, and inside two
    contexts that only overlap (the outer one closes first)."""
    import torch

    import tplab

    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        y = lin(x)
        (y * y).sum().backward()

    with tplab.memory() as alone:
        step()
    with tplab.memory() as outer:
        step()
        with tplab.memory() as inner:
            step()
    a = tplab.memory()
    a.__enter__()
    step()                              # counted by a only
    b = tplab.memory()
    b.__enter__()
    step()                              # counted by both
    a.__exit__(None, None, None)
    step()                              # counted by b only
    b.__exit__(None, None, None)
    with tplab.memory() as after:       # nothing left behind by the overlap
        step()
    again = tplab.memory()
    with again, pytest.raises(RuntimeError, match="already open"):
        again.__enter__()
    return {k: m.summary() for k, m in [("alone", alone), ("outer", outer), ("inner", inner),
                                        ("a", a), ("b", b), ("after", after)]}


def test_nested_memory_contexts_both_count(labs):
    import torch.distributed as dist

    lab = labs.get(2)
    runs = [nested_steps(), tplab.simulate(2).run(nested_steps)[1], lab.run(nested_steps)[1]]
    for got in runs:
        one = got["alone"]["activation_bytes"]
        assert one == 2 * 4 * 8 * 4
        assert got["inner"]["activation_bytes"] == one
        assert got["outer"]["activation_bytes"] == 2 * one
        assert got["outer"]["peak_bytes"] == got["inner"]["peak_bytes"] == one
        assert got["outer"]["rows"] == [{"module": "", "bytes": 2 * one, "storages": 4}]
        assert got["a"]["activation_bytes"] == got["b"]["activation_bytes"] == 2 * one
        assert got["after"] == got["alone"]
    # the lab still runs an all-reduce
    assert lab.run(lambda: _all_reduce_sum(dist)) == [3.0, 3.0]


def _all_reduce_sum(dist):
    import torch

    t = torch.ones(()) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return float(t)


def test_parameters_used_outside_a_module_are_left_out_when_the_model_is_given():
    import torch

    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    with tplab.memory() as unknown:
        (x @ lin.weight.t()).sum().backward()      # no module ran: the weight looks like data
    with tplab.memory(lin) as known:
        (x @ lin.weight.t()).sum().backward()
    assert unknown.activation_bytes == 4 * 8 * 4 + 8 * 8 * 4
    assert known.activation_bytes == 4 * 8 * 4 and known.param_bytes == 8 * 8 * 4


def test_uneven_shards_come_back_per_rank_in_simulate():
    def step():
        import torch
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = tplab.make_mesh(tp=2)
        x = distribute_tensor(torch.ones(5, 4), mesh["tp"], [Shard(0)]).requires_grad_()
        with tplab.memory() as m:
            y = x * 2           # a new storage on each rank (x's shards share a padded one)
            (y * y).sum().backward()
        return m.activation_bytes

    # rank 0 holds 3 rows, rank 1 holds 2: the mul saves y (its local tensor), once
    assert tplab.simulate(2).run(step) == [3 * 4 * 4, 2 * 4 * 4]


def test_memory_refuses_what_it_cannot_measure():
    with pytest.raises(TypeError, match="nn.Module"):
        tplab.memory(3)
    with pytest.raises(TypeError, match="Optimizer"):
        tplab.memory(optimizer="adam")
    with pytest.raises(ValueError, match="not divisible"):
        lab_memory("block", models.Config(n_heads=4), 3)
    with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda'\), not 'gpu'"):
        lab_memory("block", models.Config(), 2, device="gpu")


H200_RUN = pathlib.Path(__file__).parent.parent / "benchmarks/results/gpu-2026-12-04-memory.json"


def test_lab_memory_on_cuda_is_what_an_h200_measured():
    """What tplab.memory measured on every rank of a 4-rank lab of CUDA tensors on an H200
    (benchmarks/gpu_memory.py, run on the lent GPU; torch 2.11) is `lab_memory(...,
    device="cuda")`, row by row, and on CPU `device="cpu"`: notebook 10's assert, on both."""
    run = json.loads(H200_RUN.read_text())
    assert run["environment"]["gpus"][0]["name"] == "NVIDIA H200"
    cases = [c for c in run["memory"]["cases"] if c["case"].startswith("block")]
    assert len(cases) == 7 and {(c["tp"], c["sp"]) for c in cases} >= {(4, True), (1, False)}
    cfg = models.Config(dim=64, n_heads=8, hidden_dim=192, seq_len=32, batch_size=4)
    for c in cases:
        for device in ("cpu", "cuda"):
            predicted = lab_memory("block", cfg, c["tp"], c["sp"], device=device)
            assert all(r["summary"] == predicted for r in c[device]), (c["case"], c["tp"],
                                                                      c["sp"], device)
    # the difference is the norms (fused: input and rstd) and attention's 16 B of RNG state
    one = {d: lab_memory("block", cfg, 1, device=d)["activation_bytes"] for d in ("cpu", "cuda")}
    assert one["cpu"] - one["cuda"] == 2 * 4 * cfg.dim * 32 * 4 - 16


def test_a_cuda_ranks_attention_pads_its_logsumexp():
    # the memory-efficient kernel keeps logsumexp for ceil(s / 32) * 32 query positions
    cfg = models.Config(dim=64, n_heads=8, hidden_dim=192, seq_len=40, batch_size=2)
    row = {d: next(r["bytes"] for r in lab_memory("block", cfg, 2, device=d)["rows"]
                   if r["module"] == "attention") for d in ("cpu", "cuda")}
    assert row["cuda"] - row["cpu"] == 4 * 2 * (8 // 2) * (64 - 40) + 16


# --- the model on paper -------------------------------------------------------------------

GPT = BlockShape(hidden=1024, heads=16, seq=2048, batch=2)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_gpt_layer_has_korthikanti_constants(t):
    s, b, h, a = GPT.seq, GPT.batch, GPT.hidden, GPT.heads
    sbh = s * b * h

    def act(**kw):
        return cost.activation_bytes(GPT, t, layout="gpt", **kw)

    assert act() == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert act(sequence_parallel=True) == sbh / t * (34 + 5 * a * s / h)
    assert act(recompute="selective") == sbh * (10 + 24 / t)
    assert act(recompute="selective", sequence_parallel=True) == sbh * 34 / t
    assert act(recompute="full") == 2 * sbh
    if t == 1:
        assert act() == sbh * (34 + 5 * a * s / h)


def test_tplab_block_differs_from_the_paper_by_the_documented_bytes():
    shape = BlockShape(hidden=1024, heads=16, seq=1, gated=True)   # one token, f = 4h
    h, a = shape.hidden, shape.heads
    ours = sum(i.per_token * i.element_bytes for i in tplab_layer(shape))
    paper = sum(i.per_token * i.element_bytes for i in gpt_layer(shape))
    assert paper == 34 * h + 5 * a * shape.seq
    assert ours == 60 * h + 4 * a + 8
    assert ours - paper == 12 * h + 8 - 2 * h - 5 * a * shape.seq + 4 * a + 16 * h
    # selective recomputation removes nothing from a fused-attention block
    assert layer_saved(shape, "selective") == layer_saved(shape)
    for t in (2, 4, 8):   # SP: tplab keeps the gathered linear inputs, 4h (t-1)/t per token
        s = shape.with_(seq=8 * t)
        megatron_style = sum(i.local_bytes(s.tokens, t, True) for i in tplab_layer(s)
                             if not i.module.endswith(".wq") and not i.module.endswith(".w1")
                             ) + 2 * 2 * h * s.tokens // t
        assert cost.activation_bytes(s, t, True) - megatron_style == 4 * h * (t - 1) * 8


def test_gpu_memory_bytes_per_parameter_for_each_precision():
    shape = cost.MODELS["Llama-3 8B"]
    assert cost.param_count(shape) == pytest.approx(8.03e9, rel=1e-3)
    assert cost.param_count(cost.MODELS["Llama-3 70B"]) == pytest.approx(70.55e9, rel=1e-3)
    # Megatron's bf16 recipe: 2 + 4 (fp32 grads) + 12 = 18; the ZeRO paper's 2 + 2 + 12 = 16
    for precision, per in (("mixed", 18), ("mixed_bf16_grads", 16), ("fp32", 16),
                           ("bf16", 8)):
        m = cost.gpu_memory(shape, precision=precision)
        states = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
        assert states == pytest.approx(per * cost.param_count(shape))
    # the distributed optimizer over d replicas: 6 + 12/d (Megatron-LM's docs)
    for d in (2, 8, 64):
        m = cost.gpu_memory(shape, dp=d, zero=1)
        states = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
        assert states == pytest.approx((6 + 12 / d) * cost.param_count(shape))
    m1, m8 = cost.gpu_memory(shape, 1), cost.gpu_memory(shape, 8)
    assert m8["param_bytes"] < m1["param_bytes"] / 7.9   # only the norms stay whole
    with pytest.raises(ValueError, match="precision"):
        cost.gpu_memory(shape, precision="fp8")
    with pytest.raises(ValueError, match="recompute"):
        cost.gpu_memory(shape, recompute="some")


def test_best_tp_with_a_memory_limit():
    hw = cost.HARDWARE["H100 SXM"].with_(nics_per_node=1)   # one NIC: fastest at TP 8
    shape = cost.MODELS["Llama-3 70B"]
    rows = cost.sweep(shape, hw, sequence_parallel=True)
    assert cost.best_tp(rows, "latency") == 8
    fits = [r["tp"] for r in rows if r["memory_bytes"] <= hw.memory]
    assert fits and fits[0] > 1 and all(r["fits"] == (r["tp"] in fits) for r in rows)
    assert all(r["fits"] == (r["memory_bytes"] <= hw.usable_memory) for r in rows)
    assert cost.best_tp(rows, "latency", memory_limit=hw.memory) == min(
        (r for r in rows if r["tp"] in fits), key=lambda r: r["step_s"])["tp"]
    assert cost.best_tp(rows, memory_limit=1e9) is None    # nothing fits in 1 GB
    limit = next(r for r in rows if r["tp"] == 16)["memory_bytes"]
    fitting = [r for r in rows if r["memory_bytes"] <= limit]    # 16, 32, 64: not 8
    assert cost.best_tp(rows, "latency", memory_limit=limit) == min(
        fitting, key=lambda r: r["step_s"])["tp"] != 8
    with pytest.raises(ValueError, match="memory_bytes"):
        cost.best_tp([{"tp": 1, "step_s": 1.0}], memory_limit=1e9)


# --- the explorer's memory view -----------------------------------------------------------

def test_explorer_memory_view_redraws_on_every_control():
    from tplab.cost.explorer import CostExplorer

    ex = CostExplorer(model="Llama-3 70B", hw="H100 SXM")

    def bars():
        return {t.name: list(t.y) for t in ex.memory_figure.data if t.type == "bar"}

    def gpu_line():   # the solid line: the chosen GPU's memory, in GB
        return [s.y0 for s in ex.memory_figure.layout.shapes if s.line.dash is None]

    first = bars()
    assert list(first) == ["parameters", "gradients", "optimizer state", "activations"]
    assert first["activations"] == pytest.approx([r["activation_bytes"] / 1e9
                                                  for r in ex.rows])
    usable = (81559 * 2**20 - 2 * 2**30) / 1e9       # nvidia-smi's MiB less the reserve
    assert gpu_line() == pytest.approx([usable])
    assert ex.fits_tp == cost.best_tp(ex.rows, memory_limit=usable * 1e9)
    seen = [first]
    for name, value in (("sequence_parallel", True), ("layout", "gpt"),
                        ("recompute", "selective"), ("precision", "fp32"),
                        ("recompute", "full"), ("seq", 8192), ("model", "Llama-3 8B")):
        ex.controls[name].value = value          # as a click does
        now = bars()
        assert now != seen[-1], name
        seen.append(now)
    acts = [r["activation_bytes"] for r in ex.rows]   # full recomputation, SP: input / t
    assert acts == pytest.approx([acts[0] / r["tp"] for r in ex.rows])
    ex.controls["hardware"].value = "H200 SXM"
    usable = (143771 * 2**20 - 2 * 2**30) / 1e9
    assert gpu_line() == pytest.approx([usable])
    assert ex.fits_tp == cost.best_tp(ex.rows, memory_limit=usable * 1e9)
    assert f"{usable:.0f} GB usable" in ex.summary.value


def test_recomputation_costs_time_and_saves_memory():
    hw = cost.HARDWARE["H100 SXM"]
    shape = cost.MODELS["Llama-3 8B"]
    none, full = (cost.step_time(shape, 8, hw, recompute=rc, gemm="flat")
                  for rc in ("none", "full"))
    blocks = {k: r["compute_s"] - r["lm_head_s"] for k, r in (("none", none), ("full", full))}
    assert blocks["full"] == pytest.approx(4 / 3 * blocks["none"])   # a second forward
    assert full["lm_head_s"] == none["lm_head_s"] > 0                # the head is not re-run
    assert full["tp_comm_s"] == pytest.approx(1.5 * none["tp_comm_s"])     # its collectives
    assert full["activation_bytes"] == shape.layers * shape.tokens * shape.hidden * 2
    gpt = [cost.step_time(shape, 8, hw, layout="gpt", recompute=rc) for rc in ("none",
                                                                            "selective")]
    assert gpt[1]["compute_s"] > gpt[0]["compute_s"]
    assert gpt[1]["activation_bytes"] < gpt[0]["activation_bytes"]


def test_memory_bars_clip_what_towers_over_the_gpus():
    from tplab.cost.figures import memory_bars

    rows = cost.sweep(cost.MODELS["Llama-3 70B"], cost.HARDWARE["H200 SXM"])
    fig = memory_bars(rows, memory=141e9)
    top = fig.layout.yaxis.range[1]
    over = [r for r in rows if r["memory_bytes"] / 1e9 > top]
    notes = [a.text for a in fig.layout.annotations if "↑" in (a.text or "")]
    assert over and len(notes) == len(over)
    assert notes[0] == f"{over[0]['memory_bytes'] / 1e9:,.0f} GB ↑"
    fits = [a for a in fig.layout.annotations if a.text == "fits"]
    assert fits[0].x == next(i for i, r in enumerate(rows) if r["fits"])
