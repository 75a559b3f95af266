"""Why each collective ran: `cause` on trace records, `Trace.explain()` with conjugates,
and the module a hand-written autograd Function's backward collective belongs to."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tp_fixtures import CFG, tp_lab  # noqa: F401

ROW_OUT = "Partial(sum) -> Replicate() (RowwiseParallel output)"
F_BACK = "Partial(sum) -> Replicate()"


def _traced(kind, path, sequence_parallel, cfg):
    """Rank side: one traced step; the records and explain()'s rows."""
    import tplab
    from tplab import megatron, models, plans
    from tplab.mesh import make_mesh

    mesh = make_mesh()
    model = {"mlp": models.MLP, "block": models.Block}[kind](cfg)
    if path == "megatron":
        model = megatron.parallelize(model, mesh, sequence_parallel=sequence_parallel)
    else:
        plan = plans.mlp() if kind == "mlp" else plans.block(sequence_parallel)
        model = tplab.apply_plan(model, mesh, plan)
    x = models.make_input(cfg).requires_grad_()
    with tplab.trace() as t:
        model(x).pow(2).sum().backward()
    return {"records": t.records, "explain": list(t.explain()), "text": str(t.explain())}


def rows(result):
    return [(r["phase"], r["module"], r["op"], r["cause"]) for r in result["records"]]


def test_dtensor_mlp_causes_are_the_redistributions(tp_lab):  # noqa: F811
    for r in tp_lab.run(_traced, "mlp", "dtensor", False, CFG):
        assert rows(r) == [("forward", "w2", "all_reduce", ROW_OUT),
                           ("backward", "w1", "all_reduce", F_BACK)]
        assert [e["conjugate"] for e in r["explain"]] == [
            "identity in the backward pass", "identity in the forward pass"]
        assert "conjugate" in r["text"] and ROW_OUT in r["text"]


def test_megatron_mlp_names_f_and_g_and_gives_f_to_w1(tp_lab):  # noqa: F811
    # f is applied by a hook on the whole MLP; its backward all-reduce guards w1's input
    for r in tp_lab.run(_traced, "mlp", "megatron", False, CFG):
        assert rows(r) == [("forward", "w2", "all_reduce", "g"),
                           ("backward", "w1", "all_reduce", "f")]


def test_block_causes_with_and_without_sequence_parallelism(tp_lab):  # noqa: F811
    plain = tp_lab.run(_traced, "block", "dtensor", False, CFG)[0]
    assert [c for *_, c in rows(plain)] == [ROW_OUT] * 2 + [F_BACK] * 5
    sp = tp_lab.run(_traced, "block", "dtensor", True, CFG)[0]
    causes = {(p, m, c) for p, m, _, c in rows(sp)}
    assert ("forward", "attention", "Shard(1) -> Replicate() (PrepareModuleInput input)") in causes
    assert ("forward", "attention.wo",
            "Partial(sum) -> Shard(1) (RowwiseParallel output)") in causes
    # the conjugate of the forward all-gather is a backward reduce-scatter, and it ran
    gather = next(e for e in sp["explain"] if e["module"] == "attention"
                  and e["phase"] == "forward")
    assert gather["conjugate"] == ("reduce_scatter in the backward pass "
                                   "(Partial(sum) -> Shard(1))")
    assert ("backward", "attention", "reduce_scatter", "Partial(sum) -> Shard(1)") in rows(sp)


def test_megatron_sequence_parallel_block_names_every_operator(tp_lab):  # noqa: F811
    r = tp_lab.run(_traced, "block", "megatron", True, CFG)[0]
    got = [(p, m, c) for p, m, _, c in rows(r)]
    assert got[:4] == [("forward", "attention", "sp all-gather"),
                       ("forward", "attention.wo", "sp reduce-scatter"),
                       ("forward", "feed_forward", "sp all-gather"),
                       ("forward", "feed_forward.w2", "sp reduce-scatter")]
    assert ("backward", "ffn_norm", "dW all-reduce") in got
    assert ("backward", "attention_norm", "dW all-reduce") in got
    explained = {(e["phase"], e["cause"], e["conjugate"]) for e in r["explain"]}
    assert ("backward", "sp all-gather", "all_gather in the forward pass") in explained


class _MyF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Hand(torch.nn.Module):
    """A hand-written column-then-row pair whose f is applied in forward, outside a layer."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        x = _MyF.apply(x, dist.group.WORLD)
        return self.down(self.up(x))


def _hand_step():
    import tplab

    model = _Hand()
    x = torch.ones(2, 4, requires_grad=True)
    with tplab.trace() as t:
        model(x).sum().backward()
        dist.barrier()
    return t.records


def test_a_hand_written_function_backward_belongs_to_the_layer_it_guards(tp_lab):  # noqa: F811
    for records in tp_lab.run(_hand_step):
        f, barrier = records
        assert (f["phase"], f["module"], f["op"]) == ("backward", "up", "all_reduce")
        assert f["cause"].startswith("_MyF.backward: ")
        if tp_lab.backend == "simulated":  # processes may get the class without its file
            assert f["cause"].startswith("_MyF.backward: test_causes.py:")
            assert f["cause"].endswith("dist.all_reduce(grad, group=ctx.group)")
        # anything else: the user's line
        assert barrier["cause"].startswith("test_causes.py:")
        assert barrier["cause"].endswith("dist.barrier()")


@pytest.mark.parametrize("op,phase,cause,want", [
    ("all_gather", "forward", "Shard(1) -> Replicate()",
     "reduce_scatter in the backward pass (Partial(sum) -> Shard(1))"),
    ("all_to_all", "forward", "Shard(0) -> Shard(1)",
     "all_to_all in the backward pass (Shard(1) -> Shard(0))"),
    ("all_gather", "backward", "scatter", "split (keep my chunk) in the forward pass")])
def test_conjugates(op, phase, cause, want):
    from tplab.explain import conjugate

    assert conjugate({"op": op, "phase": phase, "cause": cause}) == want
