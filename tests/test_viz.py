"""tplab.viz: the figures' data (blocks, boxes, markers, points), on synthetic rank results
that follow docs/CONTRACTS.md. grad_flow, on real traces from tplab.simulate too, is in
test_viz_flow.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tplab import viz
from tplab.core.placements import parse as parse_placement
from tplab.core.transfer import LocalShard
from tplab.viz import comm_timeline, grad_error, mesh_map, rank_color, sharding_map
from tplab.viz.palette import PHASE_COLORS, group_look
from tplab.viz.sharding import blocks


def shards(shape, placements, mesh=(4,), names=("tp",), offsets=True):
    """Per-rank LocalShards of a DTensor of `shape`, cut by torch.chunk's rule like DTensor."""
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    out = []
    for rank, coord in enumerate(itertools.product(*[range(m) for m in mesh])):
        sl, offs = [slice(0, n) for n in shape], [0] * len(shape)
        for md, p in enumerate(placements):
            kind, dim = parse_placement(p)
            if kind == "shard":
                n = sl[dim].stop - sl[dim].start
                chunk = math.ceil(n / mesh[md])
                start = min(coord[md] * chunk, n)
                size = max(0, min(chunk, n - start))
                sl[dim] = slice(sl[dim].start + start, sl[dim].start + start + size)
                offs[dim] += start
        out.append(LocalShard(full[tuple(sl)].clone(), tuple(placements), tuple(shape), mesh,
                              names, coord, rank, offsets=tuple(offs) if offsets else ()))
    return out


def rec(rank, seq, phase, module, op, shape=(2, 8, 16), dur=0.05):
    return {"rank": rank, "seq": seq, "phase": phase, "module": module, "op": op,
            "shape": list(shape), "dtype": "float32", "bytes": 4 * math.prod(shape),
            "group": "tp", "group_size": 4, "duration_ms": dur}


def megatron_mlp(world=4):
    """What a Megatron MLP step records: g's all-reduce after w2, f's before w1 (backward)."""
    return [[rec(r, 0, "forward", "mlp.w2", "all_reduce"),
             rec(r, 1, "backward", "mlp.w1", "all_reduce")] for r in range(world)]


def block_blocks(fig, tensor):
    return [t.meta for t in fig.data if isinstance(t.meta, dict) and t.meta["tensor"] == tensor]


# --- sharding_map ----------------------------------------------------------------------------

def test_parse_placement_long_and_short_forms():
    assert parse_placement("Shard(1)") == parse_placement("S(1)") == ("shard", 1)
    assert parse_placement("Shard(dim=0)") == ("shard", 0)
    assert parse_placement("_S(0, 2)") == ("shard", 0)
    assert parse_placement("R") == parse_placement("Replicate()") == ("replicate", None)
    assert parse_placement("P(avg)") == ("partial", "avg")
    with pytest.raises(ValueError):
        parse_placement("Banana()")


def test_sharding_map_colwise_rowwise_and_replicated_on_1d_mesh():
    params = {"w1.weight": shards((16, 8), ["Shard(0)"]),
              "w2.weight": shards((8, 16), ["S(1)"]),
              "w2.bias": shards((8,), ["Replicate()"])}
    fig = sharding_map(params)
    w1 = block_blocks(fig, "w1.weight")
    assert [b["rows"] for b in w1] == [[0, 4], [4, 8], [8, 12], [12, 16]]
    assert all(b["cols"] == [0, 8] and b["kind"] == "sole" for b in w1)
    assert [b["ranks"] for b in w1] == [[0], [1], [2], [3]]
    w2 = block_blocks(fig, "w2.weight")
    assert [b["cols"] for b in w2] == [[0, 4], [4, 8], [8, 12], [12, 16]]
    (bias,) = block_blocks(fig, "w2.bias")
    assert bias == {"tensor": "w2.bias", "ranks": [0, 1, 2, 3], "kind": "replicated",
                    "rows": [0, 1], "cols": [0, 8]}
    # A rank's block has the rank's colour; the legend lists each rank once, in order.
    fills = {t.meta["ranks"][0]: t.fillcolor for t in fig.data
             if isinstance(t.meta, dict) and t.meta["kind"] == "sole"}
    assert fills == {r: rank_color(r) for r in range(4)}
    legend = [t.name for t in fig.data if t.showlegend is not False and t.name]
    assert legend[-4:] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert "replicated" in legend and "partial" not in legend
    assert len(fig.layout.annotations) >= 3  # one title per tensor
    assert "w1.weight" in fig.layout.annotations[0].text


def test_sharding_map_on_2d_mesh_shows_copies_and_partial_sums():
    mesh, names = (2, 2), ("dp", "tp")
    params = {"w": shards((8, 8), ["R", "S(0)"], mesh, names),
              "x": shards((8, 8), ["S(0)", "S(1)"], mesh, names),
              # no offsets given: the map falls back to torch.chunk's rule
              "g": shards((8, 8), ["P(sum)", "S(1)"], mesh, names, offsets=False)}
    fig = sharding_map(params)
    w = block_blocks(fig, "w")
    assert [(b["ranks"], b["rows"], b["kind"]) for b in w] == [
        ([0, 2], [0, 4], "replicated"), ([1, 3], [4, 8], "replicated")]
    x = block_blocks(fig, "x")
    assert {(tuple(b["rows"]), tuple(b["cols"])): b["ranks"] for b in x} == {
        ((0, 4), (0, 4)): [0], ((0, 4), (4, 8)): [1], ((4, 8), (0, 4)): [2],
        ((4, 8), (4, 8)): [3]}
    g = block_blocks(fig, "g")
    assert [(b["ranks"], b["cols"], b["kind"]) for b in g] == [
        ([0, 2], [0, 4], "partial"), ([1, 3], [4, 8], "partial")]
    assert "dp=2 × tp=2" in fig.layout.title.text
    assert "Partial" in fig.layout.title.text  # the note explains the cross-hatching


def test_sharding_map_takes_one_dtensor_per_rank_dicts_and_plain_tensors():
    fig = sharding_map(shards((10,), ["Shard(0)"]), name="b")  # uneven: 3, 3, 3, 1
    assert [b["cols"] for b in block_blocks(fig, "b")] == [[0, 3], [3, 6], [6, 9], [9, 10]]
    five = sharding_map(shards((5,), ["Shard(0)"]), name="b")  # 2, 2, 1 and nothing
    assert [b["ranks"] for b in block_blocks(five, "b")] == [[0], [1], [2]]
    per_rank = [{"a": s, "t": torch.ones(3)} for s in shards((4, 4), ["S(1)"])]
    fig = sharding_map(per_rank)
    assert len(block_blocks(fig, "a")) == 4
    assert block_blocks(fig, "t")[0]["kind"] == "replicated"  # a plain tensor on every rank
    with pytest.raises(ValueError, match="different shapes"):
        sharding_map({"t": [torch.ones(2), torch.ones(3)]})
    with pytest.raises(ValueError, match="1-D and 2-D"):
        blocks(shards((2, 2, 4), ["S(2)"]))


# --- comm_timeline -----------------------------------------------------------------------------

def test_comm_timeline_lanes_phases_and_hover():
    fig = comm_timeline(megatron_mlp())
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert list(bars) == ["forward", "backward"]
    assert list(bars["forward"].y) == [f"rank {r}" for r in range(4)]
    assert bars["forward"].marker.color == PHASE_COLORS["forward"]
    assert [m["module"] for m in bars["backward"].meta] == ["mlp.w1"] * 4
    assert all(b < 0.5 for b in bars["forward"].base) and all(
        b > 0.5 for b in bars["backward"].base)  # the backward box comes second
    hover = bars["forward"].customdata[0]
    assert hover[0] == "all-reduce" and hover[2] == "mlp.w2" and hover[4] == "1.0 KiB"
    lanes = next(t for t in fig.data if t.type == "scatter")
    assert list(lanes.marker.color) == [rank_color(r) for r in range(4)]
    flat = comm_timeline([r for rank in megatron_mlp() for r in rank])
    assert [t.to_plotly_json() for t in flat.data] == [t.to_plotly_json() for t in fig.data]


def test_comm_timeline_time_axis_and_disagreeing_ranks():
    trace = megatron_mlp(2)
    trace[1][0]["duration_ms"] = 0.2
    fig = comm_timeline(trace, x="time")
    bwd = next(t for t in fig.data if t.name == "backward")
    assert list(bwd.base) == pytest.approx([0.05, 0.2])  # after each rank's forward box
    short = megatron_mlp()
    short[2] = short[2][:1]  # rank 2 skipped f's all-reduce
    fig = comm_timeline(short)
    assert len(next(t for t in fig.data if t.name == "backward").y) == 3
    assert "rank 2: 1" in fig.layout.title.text
    empty = comm_timeline([[], []])
    assert "No collectives" in empty.layout.annotations[0].text
    with pytest.raises(ValueError):
        comm_timeline(megatron_mlp(), x="bytes")


def two_d_step():
    """A step on a dp=2 x tp=2 mesh (notebook 06): g on tp, then each weight's gradient
    averaged on dp, in the backward pass."""
    trace = []
    for r in range(4):
        recs = [rec(r, 0, "forward", "w2", "all_reduce"),
                rec(r, 1, "backward", "w1", "all_reduce"),
                rec(r, 2, "backward", "w2", "all_reduce", shape=(16,)),
                rec(r, 3, "backward", "w1", "all_reduce", shape=(16, 16))]
        for x in recs[2:]:
            x.update(group="dp", group_size=2)
        trace.append(recs)
    return trace


def test_comm_timeline_tells_the_groups_of_a_2d_mesh_apart():
    fig = comm_timeline(two_d_step())
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert list(bars) == ["forward · tp", "backward · tp", "backward · dp"]
    dp = bars["backward · dp"]
    assert {m["group"] for m in dp.meta} == {"dp"} and len(dp.meta) == 8
    assert [m["seq"] for m in dp.meta[:2]] == [2, 3] and list(dp.base[:2]) == [1.55, 2.55]
    assert dp.text[0] == "all-reduce · dp<br>w2"  # the group is written on every box
    assert bars["forward · tp"].text[0] == "all-reduce · tp<br>w2"
    # drawn apart too: tp plain, dp hatched, in the phase's colour; one legend entry each
    assert bars["forward · tp"].marker.pattern.shape == "" == group_look("tp", ["dp"])[0]
    assert dp.marker.pattern.shape == "/" and dp.marker.color == PHASE_COLORS["backward"]
    assert fig.layout.legend.title.text == "phase · group"
    assert "tp plain, dp hatched" in fig.layout.title.text
    narrow = comm_timeline([r * 3 for r in two_d_step()])  # 12 columns: short labels
    assert next(t for t in narrow.data if t.name == "backward · dp").text[0] == "AR·dp"
    one = comm_timeline(megatron_mlp())  # one group: as before, nothing added
    assert [t.name for t in one.data if t.type == "bar"] == ["forward", "backward"]
    assert not any("·" in text for t in one.data if t.type == "bar" for text in t.text)


# --- mesh_map ----------------------------------------------------------------------------------

def squares(fig):
    """rank -> (coordinate, centre x, centre y, colour) of its square."""
    return {t.meta["rank"]: (t.meta["coordinate"], sum(t.x[:4]) / 4, sum(t.y[:4]) / 4,
                             t.fillcolor)
            for t in fig.data if isinstance(t.meta, dict) and "rank" in t.meta}


def outlines(fig):
    return [t for t in fig.data if isinstance(t.meta, dict) and "dim" in t.meta]


def test_mesh_map_2d_rows_are_tp_groups_columns_dp_groups():
    fig = mesh_map((2, 2))
    assert squares(fig) == {0: ((0, 0), 0.5, -0.5, rank_color(0)),
                            1: ((0, 1), 1.5, -0.5, rank_color(1)),
                            2: ((1, 0), 0.5, -1.5, rank_color(2)),
                            3: ((1, 1), 1.5, -1.5, rank_color(3))}
    groups = {(t.meta["dim"], t.meta["group"]): t.meta["ranks"] for t in outlines(fig)}
    assert groups == {("tp", 0): [0, 1], ("tp", 1): [2, 3], ("dp", 0): [0, 2], ("dp", 1): [1, 3]}
    dash = {t.meta["dim"]: t.line.dash for t in outlines(fig)}
    assert dash == {"tp": "solid", "dp": "dash"}  # as group_look has them in every figure
    assert [t.name for t in fig.data if t.showlegend] == ["tp group (a row)",
                                                          "dp group (a column)"]
    labels = next(t for t in fig.data if t.name == "ranks")
    assert labels.text[3] == "<b>rank 3</b><br>(1, 1)"
    assert "dp=2 × tp=2" in fig.layout.title.text and "(dp, tp)" in fig.layout.title.text
    texts = {a.text for a in fig.layout.annotations}
    assert {"tp group 0", "tp group 1", "dp group 0", "dp group 1"} <= texts
    # ranks as DeviceMesh.mesh.tolist() gives them, laid out column-major here
    turned = mesh_map((2, 2), ("dp", "tp"), ranks=[[0, 2], [1, 3]])
    assert squares(turned)[2][:3] == ((0, 1), 1.5, -0.5)
    assert {(t.meta["dim"], t.meta["group"]): t.meta["ranks"] for t in outlines(turned)}[
        ("tp", 0)] == [0, 2]


def test_mesh_map_1d_and_bad_input():
    fig = mesh_map(4)
    assert [c for c, *_ in squares(fig).values()] == [(0,), (1,), (2,), (3,)]
    (row,) = outlines(fig)
    assert row.meta == {"dim": "tp", "group": 0, "ranks": [0, 1, 2, 3]}
    assert "tp=4" in fig.layout.title.text
    with pytest.raises(ValueError, match="1-D and 2-D"):
        mesh_map((2, 2, 2))
    with pytest.raises(ValueError, match="dim names"):
        mesh_map((2, 2), ("tp",))
    with pytest.raises(ValueError, match="shape"):
        mesh_map((2, 2), ranks=[[0, 1, 2], [3]])


def test_viz_exports():
    from tplab.viz import palette

    assert viz.style is palette.style and viz.human_bytes(1536) == "1.5 KiB"
    assert {"mesh_map", "forward_stages", "style", "human_bytes"} <= set(viz.__all__)


# --- grad_error --------------------------------------------------------------------------------

class Report:
    atol = 1e-5
    rows = [{"name": "out", "kind": "output", "max_abs": 2e-7, "max_rel": 1e-6},
            {"name": "x", "kind": "input_grad", "max_abs": 0.4, "max_rel": 0.7},
            {"name": "w1.weight", "kind": "param_grad", "max_abs": 0.0, "max_rel": 0.0},
            {"name": "w2.bias", "kind": "param_grad", "max_abs": float("nan"), "max_rel": 0.0},
            {"name": "x", "kind": "replica_spread", "max_abs": 0.5, "max_rel": 1.0},
            {"name": "w2.bias", "kind": "replica_spread", "max_abs": 0.0, "max_rel": 0.0}]


def test_grad_error_log_axis_floor_tolerance_and_spread_panel():
    fig = grad_error(Report())
    pts = {(m["name"], m["kind"]): m for t in fig.data if isinstance(t.meta, (list, tuple))
           for m in t.meta}
    assert pts[("out", "output")]["status"] == "ok"
    assert pts[("x", "input_grad")]["status"] == "bad"
    assert pts[("w2.bias", "param_grad")]["status"] == "bad"  # NaN is never within tolerance
    exact = pts[("w1.weight", "param_grad")]
    assert exact["status"] == "exact" and exact["x"] == pytest.approx(1e-9)  # 2 decades under
    assert pts[("x", "replica_spread")]["status"] == "bad"
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    spread = [t for t in fig.data if t.yaxis == "y2" and t.mode == "markers"]
    assert sorted(m["name"] for t in spread for m in t.meta) == ["w2.bias", "x"]
    assert any(s.x0 == 1e-5 == s.x1 for s in fig.layout.shapes)  # the tolerance line
    assert "2 exact" in fig.layout.title.text and "3 over" in fig.layout.title.text
    plain = grad_error(Report.rows[:3], floor=1e-12)  # a list of rows, no tolerance
    statuses = {m["status"] for t in plain.data if isinstance(t.meta, (list, tuple))
                for m in t.meta}
    assert statuses == {"plain", "exact"} and not plain.layout.shapes
    assert len([a for a in plain.layout.annotations]) == 1  # one panel title: no spread rows


def test_grad_error_draws_each_tensors_own_tolerance_with_rtol():
    class WithRtol:
        atol, rtol = 1e-5, 1e-4
        rows = [{"name": "w", "kind": "param_grad", "max_abs": 2e-5, "max_rel": 1e-3,
                 "ok": True},  # past atol, yet the report (which knows best) says ok
                {"name": "b", "kind": "param_grad", "max_abs": 0.0, "max_rel": 0.0, "ok": True}]
    fig = grad_error(WithRtol())
    (tick,) = [t for t in fig.data if t.name == "this tensor's tolerance"]
    assert list(tick.x) == pytest.approx([1e-5 + 1e-4 * 0.02]) and list(tick.y) == ["w · dL/dW"]
    status = {m["name"]: m["status"] for t in fig.data if isinstance(t.meta, tuple)
              for m in t.meta}
    assert status == {"w": "ok", "b": "exact"}  # the report's own verdict wins over atol
