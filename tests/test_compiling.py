"""torch.compile (inductor, CPU) on a TP model: grad_check, train_check and tplab.trace.

Compiling costs tens of seconds per rank here, so these run at world 2 on one small MLP
(g's all-reduce forward, f's backward), sharing inductor's cache.
The truth: the compiled model's whole gradients (`full_tensor()`) against the eager model's,
and the trace of the same step eager and compiled.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

import tplab
from tplab import compiling, models, plans

CFG = models.Config(vocab_size=32, dim=16, n_layers=1, n_heads=4, hidden_dim=32, seq_len=4,
                    batch_size=2)
MLP = functools.partial(models.MLP, CFG)
INPUT = functools.partial(models.make_input, CFG)
SP = plans.mlp()  # f and g: an all-reduce each way
COMPILED = functools.partial(compiling.compiled, plan=SP)
# sequence parallel: all-gathers and reduce-scatters
SEQ = plans.mlp(sequence_parallel=True)


def _step(model, x):
    model(x).pow(2).sum().backward()


def _on_rank(compile_it: bool, plan=SP):
    from tplab.mesh import make_mesh

    torch.manual_seed(0)
    model = MLP()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    make = (functools.partial(compiling.compiled, plan=plan) if compile_it
            else functools.partial(tplab.apply_plan, plan=plan))
    model = make(model, make_mesh(tp=2))
    x = INPUT().requires_grad_()
    _step(model, x)  # compiles
    model.zero_grad()
    counts = compiling.collectives(_step, model, x)
    grads = {n.replace("_orig_mod.", ""): p.grad.full_tensor() for n, p in
             model.named_parameters()}
    return counts, grads, state


@pytest.mark.slow
def test_a_compiled_tp_step_issues_the_collectives_of_eager_mode_and_its_gradients(labs):
    lab = labs.get(2)
    eager = lab.run(_on_rank, False)[0]
    compiled = lab.run(_on_rank, True)[0]
    assert compiled[0] == eager[0], (compiled[0], eager[0])
    assert eager[0]["forward"] and eager[0]["backward"]  # g, and f (the input's gradient)
    for name, g in eager[1].items():
        torch.testing.assert_close(compiled[1][name], g)
    # grad_check and train_check on the compiled model
    report = tplab.grad_check(lab, MLP, COMPILED, INPUT)
    assert report.ok, str(report)
    assert any(r["pair"].startswith("_orig_mod.") for r in report.rows)  # paired by name
    run = tplab.train_check(lab, MLP, COMPILED, lambda i: models.make_input(CFG, seed=i),
                            steps=2, loss_fn=lambda out, x: out.pow(2).mean(), live=False)
    assert run.ok, str(run)


@pytest.mark.slow
def test_a_compiled_sequence_parallel_step_issues_the_collectives_of_eager_mode(labs):
    """SP compiled at world 2 on gloo (it was refused: issue 28's "hang", the lab reading
    dynamo compiling inside an all-gather frame as waiting): eager's collectives and
    gradients."""
    lab = labs.get(2)
    # fresh ranks: in ranks that compiled the test above's models, dynamo's per-frame
    # caches of those models are still there (its recompile limit is 8 per frame)
    lab.restart()
    eager = lab.run(_on_rank, False, SEQ)[0]
    with lab.time_limit(300):
        compiled = lab.run(_on_rank, True, SEQ)[0]
    assert compiled[0] == eager[0], (compiled[0], eager[0])
    assert set(eager[0]["forward"]) == {"all_gather", "reduce_scatter"}, eager[0]
    for name, g in eager[1].items():
        torch.testing.assert_close(compiled[1][name], g)


def test_which_plans_are_sequence_parallel():
    from tplab import megatron

    assert compiling.sequence_parallel(SEQ) and not compiling.sequence_parallel(SP)
    assert not compiling.sequence_parallel(plans.lm()) and compiling.sequence_parallel(
        plans.lm(sequence_parallel=True))
    sim = tplab.simulate(2)
    assert sim.run(_is_sp, functools.partial(megatron.parallelize, sequence_parallel=True)) \
        == [True, True]
    assert sim.run(_is_sp, megatron.parallelize) == [False, False]


def _is_sp(parallelize):
    from tplab.mesh import make_mesh

    return compiling.sequence_parallel(None, parallelize(MLP(), make_mesh(tp=2)))


def test_inductor_is_refused_with_torchs_reason_where_there_is_no_compiler():
    from torch._inductor import config

    with config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        why = compiling.why_not_inductor()
        assert why and "no-such-c++-compiler" in why and "InvalidCxxCompiler" in why, why
        with pytest.raises(tplab.PlanError, match="cannot build C\\+\\+ here"):
            compiling.compiled(MLP(), None, None)
    assert compiling.why_not_inductor() is None  # this machine has one


# --- issue 38 item 21: compositions that fail in torch itself are refused ------------------
# benchmarks/compile_compositions.py runs them in plain torch (no tplab code): TP, then
# checkpoint_wrapper, then torch.compile, fails in torch 2.13 on CPU; so does a whole-model
# compile with fully_shard on its blocks after it. FSDP2 on the root only runs.

LM_CFG = models.Config(vocab_size=32, dim=16, n_layers=2, n_heads=4, hidden_dim=32, seq_len=8,
                       batch_size=4)


def _compose(plan) -> list[str]:
    """Rank side: `plan` applied on a (dp=1, tp=2) mesh (no forward: nothing compiles); the
    FSDPModules it made."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from tplab.mesh import make_mesh

    model = plan(models.TinyLM(LM_CFG), make_mesh(dp=1, tp=dist.get_world_size()))
    return [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def test_compile_over_activation_checkpointing_or_per_block_fsdp2_is_refused(labs):
    from tplab import checkpointing, fsdp

    lab = labs.get(2)
    version = re.escape(f"torch {torch.__version__} fails there on CPU, in plain torch too")
    lm = plans.lm(loss_parallel=False)
    checkpointed = functools.partial(checkpointing.checkpointed, plan=lm)
    compiled = functools.partial(compiling.compiled, plan=lm)
    ac_then_compile = functools.partial(compiling.compiled, plan=checkpointed)
    for plan in (ac_then_compile, fsdp.fsdp_tp(ac_then_compile, per_module=("Block",))):
        with pytest.raises(tplab.PlanError, match="activation checkpointing .*then torch.compile"
                           f": {version}"):
            lab.run(_compose, plan)
    with pytest.raises(tplab.PlanError, match=f"fully_shard on its blocks.*: {version}"):
        lab.run(_compose, fsdp.fsdp_tp(compiled, per_module=("Block",)))
    # what runs: FSDP2 on the root of a compiled model, and per block uncompiled
    assert lab.run(_compose, fsdp.fsdp_tp(compiled))[0] == [""]
    assert lab.run(_compose, fsdp.fsdp_tp(checkpointed, per_module=("Block",)))[0] == \
        ["", "layers.0._checkpoint_wrapped_module", "layers.1._checkpoint_wrapped_module"]


def test_the_docstring_does_not_recommend_what_torch_cannot_run():
    doc = " ".join(compiling.__doc__.split())
    assert "torchtitan's order is TP, activation checkpointing, compile, FSDP2" not in doc
    assert "fails in torch itself on CPU" in doc and "refuses" in doc
