"""tplab's one walker over containers (`tplab.core.pytrees`): the paths `items` and `leaves`
read, the containers `map_leaves` rebuilds, and the walkers built on it."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, namedtuple

import torch

from tplab.core.pytrees import items, leaves, map_leaves, map_tensors
from tplab.core.transfer import unsendable_part

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    note: str = ""


def test_items_paths():
    assert items({"x": 1, 2: 3}, "r") == [("r.x", 1), ("r[2]", 3)]
    assert items({"x": 1}, "r", python_keys=True) == [("r['x']", 1)]
    assert items(Out(torch.zeros(1)), "o")[1] == ("o.note", "")
    assert items([5, 6], "l") == [("l[0]", 5), ("l[1]", 6)]
    assert items(torch.zeros(2)) is None and items("text") is None


def test_leaves_and_map_tensors_keep_the_containers():
    t = torch.ones(2)
    tree = {"out": Out(t, "n"), "pair": Pair(t, 3), "list": [t, "s"],
            "od": OrderedDict(k=t)}
    assert [p for p, _ in leaves(tree, "x")] == [
        "x.out.logits", "x.pair[0]", "x.list[0]", "x.od.k"]
    doubled = map_tensors(lambda v: v * 2, tree)
    assert isinstance(doubled["out"], Out) and doubled["out"].note == "n"
    assert isinstance(doubled["pair"], Pair) and doubled["pair"].b == 3
    assert type(doubled["od"]) is OrderedDict
    assert all(float(v.sum()) == 4.0 for _, v in leaves(doubled))


def test_map_leaves_with_other_leaves_and_whole_dataclasses():
    out = Out(torch.ones(1))
    got = map_leaves(lambda n: n + 1, [1, (2, out)], lambda x: isinstance(x, int),
                     into_dataclasses=False)
    assert got[0] == 2 and got[1][0] == 3 and got[1][1] is out


def test_unsendable_part_names_the_path():
    path, kind, error = unsendable_part({"ok": [1, 2], "bad": [0, {"lock": threading.Lock()}]})
    assert path == "result['bad'][1]['lock']" and kind == "_thread.lock"
    assert "pickle" in error
    assert unsendable_part([1, "two"])[1] == ""


def _per_rank():
    import torch.distributed as dist

    return {"t": Pair(torch.ones(2) * dist.get_rank(), "x"), "n": [dist.get_rank()]}


def test_a_simulated_rank_sees_its_own_values_in_any_container():
    import tplab

    with tplab.simulate(2) as sim:
        got = sim.run(_per_rank)
    for r, out in enumerate(got):
        assert isinstance(out["t"], Pair) and out["t"].b == "x"
        assert out["t"].a.tolist() == [float(r)] * 2 and out["n"] == [r]
