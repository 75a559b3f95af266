"""FSDP2 + TP (torchtitan's order) in grad_check and train_check, at world 4 in processes.

Every verdict is judged against an independent truth: the ranks' whole gradients and
parameters (DTensor's `full_tensor()`, and for hand-written TP pieces an all-gather over the
tp group by the layer's declared layout: torch's collectives, not tplab's pairing) against
one device, on the whole batch, with FSDP's averaging over dp applied (the mean of the dp
replicas' losses, each on its slice of the batch).
"""

from __future__ import annotations

import functools

import pytest
import torch

import tplab
from tplab import fsdp, fsdp_report, megatron, models, plans, rng
from tplab.core import placements
from tplab.rank.grad_step import loss_context
from tplab.training import lm, steps

CFG = models.Config(vocab_size=32, dim=16, n_layers=2, n_heads=4, hidden_dim=32, seq_len=8,
                    batch_size=4)
TINY = functools.partial(models.TinyLM, CFG)
TOKENS = functools.partial(models.make_tokens, CFG)
BATCHES = lm.counting_batches(CFG)
STEP = functools.partial(steps.lm_step, max_norm=0.5)
MEG = functools.partial(rng.parallelize, plan=megatron.parallelize, seed=1234)
NO_F = functools.partial(megatron.parallelize, reduce_grad=False)

CORRECT = {
    "DTensor TP + FSDP2 per block": fsdp.fsdp_tp(plans.lm(), per_module=("Block",)),
    "hand-written TP + FSDP2 per block": fsdp.fsdp_tp(MEG, per_module=("Block",)),
    "DTensor TP + FSDP2 on the root only": fsdp.fsdp_tp(plans.lm()),
    "DTensor TP, logits gathered (no loss_parallel)": fsdp.fsdp_tp(
        plans.lm(loss_parallel=False), per_module=("Block",)),
    # the norms' gradient hooks of sequence parallelism, carried past fully_shard (issue 38)
    "hand-written TP with sequence parallel + FSDP2 per block": fsdp.fsdp_tp(
        functools.partial(megatron.parallelize, sequence_parallel=True), per_module=("Block",)),
}
BUGS = {  # name: (plan, the mesh dim grad_check names)
    "batch sliced by the global rank": (
        fsdp.fsdp_tp(plans.lm(), per_module=("Block",), batch="global"), "tp"),
    "fully_shard on the TP dim": (fsdp.fsdp_tp(megatron.parallelize, on="tp"), "tp"),
    "a missing f": (fsdp.fsdp_tp(NO_F, per_module=("Block",)), "tp"),
    "FSDP2 sums over dp": (fsdp.fsdp_tp(plans.lm(), reduce="sum"), "dp"),
}

@pytest.fixture(scope="module")
def lab4(labs):
    return labs.get(4)


# --- the independent truth ----------------------------------------------------------------


def _whole(model, of: str) -> dict[str, torch.Tensor]:
    """Rank side: every parameter (or gradient) whole, by torch's collectives alone."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tplab.mesh import tp_group

    out = {}
    for path, module in model.named_modules():
        declared = getattr(module, "tp_placements", {})
        for name, p in module.named_parameters(recurse=False):
            t = p.grad if of == "grad" else p.detach()
            if t is None:
                continue
            t = t.full_tensor() if isinstance(t, DTensor) else t
            spec = placements.name(declared[name]) if name in declared else ""
            if spec.startswith("Shard"):  # a hand-written TP piece: gather it over tp
                group, size, _ = tp_group(module.mesh)
                parts = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, int(spec[6:-1]))
            out[f"{path}.{name}" if path else name] = t.detach().clone()
    return out


def _rank_grads(plan, state, tokens, dp):
    import torch.distributed as dist

    from tplab.mesh import make_mesh

    mesh = make_mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = TINY()
    model.load_state_dict(state)
    model = plan(model, mesh)
    mine = tokens.chunk(dp)[mesh.get_local_rank("dp")]
    logits = model(mine)
    with loss_context({"logits": logits}):
        models.lm_loss(logits, mine).backward()
    return _whole(model, "grad")


def _one_device_grads(state, tokens, dp):
    model = TINY()
    model.load_state_dict(state)
    loss = sum(models.lm_loss(model(t), t) for t in tokens.chunk(dp)) / dp  # FSDP's mean
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _grads_right(lab, plan, dp=2) -> bool:
    torch.manual_seed(0)
    state = TINY().state_dict()
    tokens = TOKENS()
    truth = _one_device_grads(state, tokens, dp)
    ranks = lab.run(_rank_grads, plan, state, tokens, dp)
    return all(name in r and torch.allclose(r[name], g, atol=1e-5, rtol=1e-4)
               for r in ranks for name, g in truth.items())


# --- grad_check -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CORRECT))
def test_a_correct_fsdp2_tp_model_passes_grad_check(lab4, name):
    assert _grads_right(lab4, CORRECT[name])
    report = tplab.grad_check(lab4, TINY, CORRECT[name], TOKENS, models.lm_loss, dp=2)
    assert report.ok, str(report)
    assert report.mesh_shape == {"dp": 2, "tp": 2}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUGS))
def test_each_planted_bug_fails_grad_check_and_names_its_mesh_dim(lab4, name):
    plan, dim = BUGS[name]
    assert not _grads_right(lab4, plan)
    report = tplab.grad_check(lab4, TINY, plan, TOKENS, models.lm_loss, dp=2)
    assert not report.ok
    dims = fsdp_report.dims_of(report)
    assert dims and set(dims.values()) == {dim}, str(report)
    assert f"from the {dim} dim" in str(report)


def test_fully_shard_on_the_tp_dim_of_a_dtensor_plan_is_refused_with_torchs_reason():
    # torch refuses it ("Cannot concatenate overlapping meshes"); fsdp_tp says so when called
    with pytest.raises(tplab.PlanError, match="Cannot concatenate overlapping meshes"):
        fsdp.fsdp_tp(plans.lm(), on="tp")


@pytest.mark.slow
def test_the_parameters_end_with_strided_placements_on_both_mesh_dims(lab4):
    def placements_of(plan):
        from tplab.layouts import tp_layout
        from tplab.mesh import make_mesh

        model = plan(TINY(), make_mesh(dp=2, tp=2))
        return {n: (i.mesh_placements, i.fsdp) for n, i in tp_layout(model).items()}

    got = lab4.run(placements_of, CORRECT["DTensor TP + FSDP2 per block"])[0]
    wq, _ = got["layers.0.attention.wq.weight"]  # colwise: dim 0 on tp, then FSDP on dim 0
    assert wq == {"dp": "_StridedShard(dim=0, split_factor=2)", "tp": "Shard(0)"}
    wo, _ = got["layers.0.attention.wo.weight"]  # rowwise: dim 1 on tp, FSDP on dim 0
    assert wo == {"dp": "Shard(0)", "tp": "Shard(1)"}
    norm, managed = got["norm.weight"]  # not in the TP plan: FSDP2's dp mesh alone
    assert norm == {"dp": "Shard(0)"} and managed


@pytest.mark.slow
def test_vocab_sharded_logits_take_their_loss_under_loss_parallel(lab4):
    def logits(plan):
        import contextlib

        from tplab.mesh import make_mesh

        mesh = make_mesh(dp=2, tp=2)
        out = plan(TINY(), mesh)(TOKENS().chunk(2)[mesh.get_local_rank("dp")])
        return (not isinstance(loss_context(out), contextlib.nullcontext),
                [placements.name(p) for p in out.placements])

    sharded = lab4.run(logits, CORRECT["DTensor TP + FSDP2 per block"])[0]
    assert sharded == (True, ["Shard(2)"])  # the vocab dim, on mesh["tp"]: loss_parallel()


# --- train_check ----------------------------------------------------------------------------


def _rank_run(plan, state, n, step, dp, make_optimizer):
    import torch.distributed as dist

    from tplab.mesh import make_mesh

    mesh = make_mesh(dp=dp, tp=dist.get_world_size() // dp)
    model = TINY()
    model.load_state_dict(state)
    model = plan(model, mesh)
    optimizer = make_optimizer(model.parameters())
    out = [_whole(model, "param")]
    for i in range(n):
        step(model, optimizer, BATCHES(i).chunk(dp)[mesh.get_local_rank("dp")])
        out.append(_whole(model, "param"))
    return out


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # train_check's default


def _first_bad_step(lab, plan, n, step=STEP, dp=2, make_optimizer=_adamw):
    """The truth: the first step whose whole parameters differ from one device's."""
    torch.manual_seed(0)
    model = TINY()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer(model.parameters())
    ref = [{k: v.detach().clone() for k, v in model.named_parameters()}]
    for i in range(n):
        step(model, optimizer, BATCHES(i))
        ref.append({k: v.detach().clone() for k, v in model.named_parameters()})
    ranks = lab.run(_rank_run, plan, state, n, step, dp, make_optimizer)
    for i in range(n + 1):
        for r in ranks:
            if any(not torch.allclose(r[i][k], v, atol=1e-4, rtol=0) for k, v in
                   ref[i].items()):
                return i
    return None


def _train(lab, plan, n=4, step=STEP, make_optimizer=None):
    return tplab.train_check(lab, TINY, plan, BATCHES, steps=n, step=step, dp=2, live=False,
                             make_optimizer=make_optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CORRECT)[:2])
def test_a_correct_fsdp2_tp_run_passes_train_check(lab4, name):
    assert _first_bad_step(lab4, CORRECT[name], 4) is None
    report = _train(lab4, CORRECT[name])
    assert report.ok, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["batch sliced by the global rank", "fully_shard on the TP dim",
                                  "a missing f"])
def test_each_planted_bug_is_caught_by_train_check_at_its_first_bad_step(lab4, name):
    plan, _ = BUGS[name]
    truth = _first_bad_step(lab4, plan, 3)
    assert truth is not None
    report = _train(lab4, plan, n=3)
    assert not report.ok and report.first_bad_step == truth, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("sync_each", [True, False], ids=["reduce-scatter each", "no sync"])
def test_gradient_accumulation_under_fsdp2(lab4, sync_each):
    step = functools.partial(fsdp.accumulate_step, micro=2, loss_fn=_lm_loss,
                             sync_each=sync_each)
    plan = CORRECT["DTensor TP + FSDP2 per block"]
    assert _first_bad_step(lab4, plan, 3, step=step) is None
    assert _train(lab4, plan, n=3, step=step).ok
    # FSDP2 summing over dp doubles every gradient: SGD shows it (Adam divides it out)
    summed = BUGS["FSDP2 sums over dp"][0]
    truth = _first_bad_step(lab4, summed, 2, step=step, make_optimizer=steps.sgd)
    report = _train(lab4, summed, n=2, step=step, make_optimizer=steps.sgd)
    assert truth is not None and report.first_bad_step == truth, str(report)


def _lm_loss(logits, tokens):
    return models.lm_loss(logits, tokens)


def test_fsdp2_under_simulate_is_refused_with_torchs_reason():
    sim = tplab.simulate(4)
    with pytest.raises(tplab.PlanError, match=r"resize_\(\) on an invalid python storage"):
        tplab.grad_check(sim, TINY, CORRECT["DTensor TP + FSDP2 per block"], TOKENS,
                         models.lm_loss, dp=2)


# --- the command line ------------------------------------------------------------------------


def _cli(*args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tplab", "check", *args],
                          cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
def test_the_cli_checks_an_fsdp2_tp_plan_with_dp():
    ok = _cli("fsdp_targets:build", "fsdp_targets:fsdp_tp", "fsdp_targets:make_input",
              "--world-size", "4", "--dp", "2", "--loss", "fsdp_targets:loss")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "(dp=2 x tp=2)" in ok.stdout and ": ok," in ok.stdout
    bad = _cli("fsdp_targets:build", "fsdp_targets:fsdp_on_tp", "fsdp_targets:make_input",
               "--world-size", "4", "--dp", "2")
    assert bad.returncode == 1 and "overlapping meshes" in bad.stderr, bad.stdout + bad.stderr


def test_the_cli_refuses_a_dp_that_does_not_divide_the_world_size():
    bad = _cli("fsdp_targets:build", "fsdp_targets:fsdp_tp", "fsdp_targets:make_input",
               "--world-size", "4", "--dp", "3", "--simulated")
    assert bad.returncode == 2 and "--dp 3 must be a positive int that divides --world-size 4" \
        in bad.stderr, bad.stderr
    sim = _cli("fsdp_targets:build", "fsdp_targets:fsdp_tp", "fsdp_targets:make_input",
               "--world-size", "4", "--dp", "2", "--simulated")
    assert sim.returncode == 1 and "resize_()" in sim.stderr, sim.stdout + sim.stderr


# --- HSDP ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hsdp_replicas_of_shards_pass_against_one_device(lab4):
    """HSDP at world 4: dp=4 split into 2 replicas x 2 shards (tp=1; HSDP x TP needs 8)."""
    import dataclasses

    cfg = dataclasses.replace(CFG, batch_size=4)
    mlp = functools.partial(models.MLP, cfg)

    def mean(out, x):
        return out.pow(2).mean()

    report = tplab.grad_check(lab4, mlp, fsdp.hsdp(), functools.partial(models.make_input, cfg),
                              mean, dp=4)
    assert report.ok, str(report)
    run = tplab.train_check(lab4, mlp, fsdp.hsdp(), functools.partial(_seeded, cfg), steps=3,
                            dp=4, loss_fn=mean, live=False)
    assert run.ok, str(run)
    with pytest.raises(tplab.PlanError, match="tp=2 needs tp_plan"):
        tplab.grad_check(lab4, mlp, fsdp.hsdp(), functools.partial(models.make_input, cfg),
                         mean, dp=2)


def _seeded(cfg, i):
    return models.make_input(cfg, seed=i)


def _reduce_scatters(sync_each):
    import torch.distributed as dist

    from tplab.mesh import make_mesh
    from tplab.tracing import trace

    mesh = make_mesh(dp=2, tp=dist.get_world_size() // 2)
    model = CORRECT["DTensor TP + FSDP2 on the root only"](TINY(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = BATCHES(0).chunk(2)[mesh.get_local_rank("dp")]
    with trace() as t:
        fsdp.accumulate_step(model, optimizer, batch, micro=2, loss_fn=_lm_loss,
                             sync_each=sync_each)
    return sum(r["op"] == "reduce_scatter" and r["group"] == "dp" for r in t.records)


@pytest.mark.slow
def test_no_sync_defers_fsdp2s_reduce_scatter_to_the_last_micro_batch(lab4):
    each = lab4.run(_reduce_scatters, True)
    last = lab4.run(_reduce_scatters, False)
    assert set(each) == {2} and set(last) == {1}, (each, last)  # one FSDP unit, 2 micro-batches
