"""tplab.megatron: each conjugate operator's forward and backward against the formula it
implements, with rank-dependent values; the parallel linears against nn.Linear."""

from __future__ import annotations

import pytest
import torch
from tp_fixtures import CFG, tp_lab  # noqa: F401

from tplab import RankError


def _operator(name, dim, dp=None):
    """Rank side: y = op(x_r) with x_r = (rank + 1) * base, then y.backward(g_r) with
    g_r = (rank + 1) * y; returns y and x's gradient (integers: exact in float32).
    With `dp`, on a (dp, tp) mesh: the operator talks within this rank's tp group."""
    import torch
    import torch.distributed as dist

    from tplab import megatron
    from tplab.mesh import make_mesh

    mesh = make_mesh() if dp is None else make_mesh(dp=dp, tp=dist.get_world_size() // dp)
    scale = torch.ones(()) * (dist.get_rank() + 1)  # a per-rank value in tplab.simulate too
    n = mesh["tp"].size()
    base = torch.arange(8.0 * n * n).reshape(2, 2 * n, 2 * n)  # every dim but 0 splits
    x = (base * scale).requires_grad_()
    op = getattr(megatron, name)
    y = op(x, mesh) if dim is None else op(x, mesh, dim=dim)
    y.backward(y.detach() * scale)
    return y.detach(), x.grad


def expected(name, dim, n, first=0):
    """The same on the notebook side, from the values of the n ranks first, first + 1, ..."""
    base = torch.arange(8.0 * n * n).reshape(2, 2 * n, 2 * n)  # every dim but 0 splits
    xs = [base * (first + r + 1) for r in range(n)]
    total = sum(xs)
    out, grads = [], []
    for r in range(n):
        s = first + r + 1
        if name == "copy_to_tp":  # f: identity; backward sums every rank's gradient
            y = xs[r]
            g = sum(xs[q] * (first + q + 1) for q in range(n))
        elif name == "reduce_from_tp":  # g: sum; backward identity
            y = total
            g = total * s
        elif name == "scatter_to_tp":  # keep chunk r; backward all-gathers the chunks
            y = xs[r].chunk(n, dim)[r]
            g = torch.cat([(xs[q].chunk(n, dim)[q] * (first + q + 1)) for q in range(n)], dim)
        elif name == "gather_from_tp":  # all-gather; backward keeps chunk r
            y = torch.cat(xs, dim)
            g = (y * s).chunk(n, dim)[r]
        elif name == "all_gather_seq":  # all-gather; backward reduce-scatters
            y = torch.cat(xs, dim)
            g = sum(torch.cat(xs, dim) * (first + q + 1) for q in range(n)).chunk(n, dim)[r]
        else:  # reduce_scatter_seq: reduce-scatter; backward all-gathers
            y = total.chunk(n, dim)[r]
            g = torch.cat([total.chunk(n, dim)[q] * (first + q + 1) for q in range(n)], dim)
        out.append(y)
        grads.append(g)
    return out, grads


OPS = [("copy_to_tp", None), ("reduce_from_tp", None), ("scatter_to_tp", -1),
       ("gather_from_tp", -1), ("scatter_to_tp", 1), ("all_gather_seq", 1),
       ("reduce_scatter_seq", 1), ("all_gather_seq", 2)]


@pytest.mark.parametrize("name,dim", OPS, ids=[f"{n}-{d}" for n, d in OPS])
def test_conjugate_operators_forward_and_backward(tp_lab, name, dim):  # noqa: F811
    n = tp_lab.world_size
    want_y, want_g = expected(name, 1 if dim is None else dim, n)
    for r, (y, g) in enumerate(tp_lab.run(_operator, name, dim)):
        assert torch.equal(y, want_y[r]), (name, r)
        assert torch.equal(g, want_g[r]), (name, r)


@pytest.mark.parametrize("name,dim", OPS, ids=[f"{n}-{d}" for n, d in OPS])
def test_conjugate_operators_on_a_2d_mesh_talk_within_each_tp_group(tp_lab, name, dim):  # noqa: F811
    if tp_lab.world_size != 4:
        pytest.skip("a (dp=2, tp=2) mesh needs 4 ranks")
    # tp groups {0, 1} and {2, 3}: each computes what a world of 2 would, from its own values
    results = tp_lab.run(_operator, name, dim, 2)
    for first in (0, 2):
        want_y, want_g = expected(name, 1 if dim is None else dim, 2, first)
        for t in range(2):
            y, g = results[first + t]
            assert torch.equal(y, want_y[t]), (name, first + t)
            assert torch.equal(g, want_g[t]), (name, first + t)


def _linears(cfg, dp=None):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from tplab import megatron, models
    from tplab.mesh import make_mesh

    mesh = make_mesh() if dp is None else make_mesh(dp=dp, tp=dist.get_world_size() // dp)
    with models.rank_free_randomness():
        torch.manual_seed(0)
        lin = nn.Linear(cfg.dim, cfg.hidden_dim)
        x = torch.randn(2, 3, cfg.dim)
    col = megatron.ColumnParallelLinear(lin, mesh, gather_output=True)
    row = megatron.RowParallelLinear(lin, mesh, input_is_parallel=False)
    return (lin(x).detach(), col(x).detach(), row(x).detach(), lin.weight.detach(),
            col.weight.detach(), row.weight.detach())


def test_parallel_linears_built_from_nn_linear_compute_the_same(tp_lab):  # noqa: F811
    n = tp_lab.world_size
    for r, (full, col, row, weight, col_w, row_w) in enumerate(tp_lab.run(_linears, CFG)):
        assert torch.allclose(col, full, atol=1e-6) and torch.allclose(row, full, atol=1e-6)
        assert torch.equal(col_w, weight.chunk(n, 0)[r])  # rows of the (out, in) weight
        assert torch.equal(row_w, weight.chunk(n, 1)[r])  # columns


def test_parallel_linears_on_a_2d_mesh_split_over_tp_only(tp_lab):  # noqa: F811
    if tp_lab.world_size != 4:
        pytest.skip("a (dp=2, tp=2) mesh needs 4 ranks")
    for r, (full, col, row, weight, col_w, row_w) in enumerate(tp_lab.run(_linears, CFG, 2)):
        t = r % 2  # (dp, tp) coordinate (r // 2, r % 2): the dp replicas hold the same shards
        assert torch.allclose(col, full, atol=1e-6) and torch.allclose(row, full, atol=1e-6)
        assert torch.equal(col_w, weight.chunk(2, 0)[t])
        assert torch.equal(row_w, weight.chunk(2, 1)[t])


def _indivisible(cfg):
    import torch.nn as nn

    from tplab import megatron
    from tplab.mesh import make_mesh

    megatron.ColumnParallelLinear(nn.Linear(cfg.dim, 6), make_mesh())


def test_an_indivisible_layer_is_a_plan_error(tp_lab):  # noqa: F811
    if tp_lab.world_size != 4:
        pytest.skip("6 features split evenly over 2 ranks")
    with pytest.raises(RankError, match="PlanError: out_features has size 6, not divisible by "
                                        "the tp size 4"):
        tp_lab.run(_indivisible, CFG)
