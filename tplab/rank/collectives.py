"""Rank side: which collectives this rank issued, where it is now, and completing a
collective that a peer never called.

Every collective entry point of torch.distributed (c10d: `dist.all_reduce`...) and of its
functional collectives (`funcol.all_reduce`..., which DTensor uses) is wrapped once, at
`init_rank`, to note the call's group, its number in that group (c10d's sequence number),
and its arguments' shapes, described at the call so that no tensor is kept (a kept tensor
would hold its autograd graph, and a checkpoint's recomputed storages, alive): a few
microseconds per collective, nothing per op. A reporter thread writes where the rank is
to the rendezvous store (tplab/rank/whereabouts.py), so the notebook can tell, without asking
the busy rank, whether it computes or waits, and in which collective of which group.

When a peer finished a cell without calling a collective that this rank waits in (the
classic `if rank == 0: dist.all_reduce(x)`), the notebook asks the finished peers to run
`complete_pending`: the same call, on the same group, with placeholder zeros. The waiting
rank is freed without a restart, so its names survive (its results are not valid).
"""

from __future__ import annotations

import collections
import functools
import threading

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d

from tplab.core import ops

WHERE_KEY = "tplab/where/{rank}"
HISTORY = 8  # collectives remembered per group, to replay the ones a peer missed

# c10d functions wrapped, with the position of their `group` argument.
C10D_CALLS = {
    "all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "_all_gather_base": 2,
    "reduce_scatter": 3, "reduce_scatter_tensor": 3, "_reduce_scatter_base": 3,
    "all_to_all": 2, "all_to_all_single": 4, "broadcast": 2, "barrier": 0,
    "reduce": 3, "gather": 3, "scatter": 3,
}
# Functions (innermost first) whose frame on the stack means "waiting in a collective":
# c10d's, by their op's name (`ops.family`), and DTensor's redistribution steps.
COLLECTIVE_FRAMES = {
    **{api: ops.family(api) for api in (*C10D_CALLS, "all_gather_tensor", ops.SEND, ops.RECV)},
    "_reduce_value": ops.ALL_REDUCE, "_reduce_shard_value": ops.REDUCE_SCATTER,
    "_to_replicate_tensor": ops.ALL_GATHER, "_to_new_shard_dim": ops.ALL_TO_ALL,
    "wait_tensor": "wait_tensor",
}
# functional collectives wrapped, with the position of their `group` argument.
FUNCOL_CALLS = {
    "all_reduce": 2, "all_gather_tensor": 2, "all_gather_tensor_autograd": 2,
    "reduce_scatter_tensor": 3, "reduce_scatter_tensor_autograd": 3,
    "all_to_all_single": 3, "broadcast": 2,
    "all_gather_single": 2, "all_gather_single_autograd": 2,
    "reduce_scatter_single": 3, "reduce_scatter_single_autograd": 3,
}




class RankReport:
    """What this rank knows about itself, shared by the main thread and the reporter."""

    def __init__(self):
        self.rank = -1
        self.cell: int | None = None  # the cell running now
        self.cell_started = 0.0
        self.last_cell: int | None = None
        self.main_thread = threading.main_thread().ident
        self.store = None
        self.reporting = True  # benchmarks/watchdog_overhead.py turns it off to compare
        self.issued: dict[str, collections.deque] = {}  # group name -> recent calls
        self.order = 0  # calls noted so far, on every group
        self.reported_cell: int | None = None  # the cell the reporter last wrote about
        # Held while a report is written and while a cell starts or ends: a reporter's
        # snapshot of a running cell can never land after the cell's final report.
        self.lock = threading.Lock()
        self.library_parts: tuple[str, ...] = ("<frozen", "threading.py")


REPORT = RankReport()


# --- noting every collective --------------------------------------------------------------


def _describe(value):
    """A JSON-able stand-in for an argument: tensors become ["T", shape, dtype]."""
    if isinstance(value, torch.Tensor):
        return ["T", list(value.shape), str(value.dtype).removeprefix("torch.")]
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return ["L", [_describe(v) for v in value]]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    name = getattr(value, "name", None)  # a ReduceOp
    if isinstance(name, str) and type(value).__name__ in ("RedOpType", "ReduceOp"):
        return ["OP", name]
    return ["?", type(value).__name__]


def _group_name(kind: str, group) -> tuple[str | None, object]:
    try:
        if kind == "c10d":
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            return pg.group_name, pg
        name = funcol._resolve_group_name(group)
        return name, dist.distributed_c10d._resolve_process_group(name)
    except Exception:
        return None, None


def _wrap(kind: str, api: str, fn, group_pos: int):
    @functools.wraps(fn)
    def noted(*args, **kwargs):
        group = kwargs.get("group", args[group_pos] if len(args) > group_pos else None)
        name, pg = _group_name(kind, group)
        if name is not None:
            try:
                seq = pg._get_sequence_number_for_group() + 1
            except Exception:
                seq = None
            calls = REPORT.issued.get(name)
            if calls is None:
                calls = REPORT.issued[name] = collections.deque(maxlen=HISTORY)
            REPORT.order += 1
            # described now, not kept: a kept tensor (and the autograd graph behind it)
            # would stay alive for HISTORY more collectives
            calls.append((seq, REPORT.order, kind, api, [_describe(a) for a in args],
                          {k: _describe(v) for k, v in kwargs.items()}, group_pos))
        return fn(*args, **kwargs)

    noted.__tplab_noted__ = True
    return noted


def note_collectives() -> None:
    """Wrap torch.distributed's collectives (once per process) so each call is noted."""
    for api, pos in C10D_CALLS.items():
        fn = getattr(c10d, api, None)
        if fn is None or getattr(fn, "__tplab_noted__", False):
            continue
        wrapped = _wrap("c10d", api, fn, pos)
        setattr(c10d, api, wrapped)
        if getattr(dist, api, None) is fn:
            setattr(dist, api, wrapped)
    for api, pos in FUNCOL_CALLS.items():
        fn = getattr(funcol, api, None)
        if fn is not None and not getattr(fn, "__tplab_noted__", False):
            setattr(funcol, api, _wrap("funcol", api, fn, pos))


def groups_now() -> dict[str, dict]:
    """group name -> {"ranks": global ranks, "seq": collectives issued on it so far}."""
    world = dist.distributed_c10d._world
    found = {}
    for pg, name in list(world.pg_names.items()):
        try:
            ranks = sorted(world.pg_group_ranks[pg])
            found[name] = {"ranks": ranks, "seq": pg._get_sequence_number_for_group(),
                           "desc": getattr(pg, "group_desc", "") or ""}
        except Exception:
            continue
    return found


def history() -> dict[str, list]:
    """group name -> recent calls, described for a peer that must replay them."""
    out = {}
    for name, calls in list(REPORT.issued.items()):
        rows = []
        for seq, order, kind, api, args, kwargs, pos in list(calls):
            rows.append({"seq": seq, "order": order, "kind": kind, "api": api,
                         "op": ops.family(api), "group_pos": pos,
                         "args": args, "kwargs": kwargs})
        out[name] = rows
    return out


# --- completing what a peer waits in ----------------------------------------------------


def _placeholder(desc):
    if isinstance(desc, list) and desc and desc[0] == "T":
        return torch.zeros(desc[1], dtype=getattr(torch, desc[2]))
    if isinstance(desc, list) and desc and desc[0] == "L":
        return [_placeholder(d) for d in desc[1]]
    if isinstance(desc, list) and desc and desc[0] == "OP":
        return getattr(dist.ReduceOp, desc[1])
    if isinstance(desc, list) and desc and desc[0] == "?":
        raise ValueError(f"cannot make a placeholder for an argument of type {desc[1]}")
    return desc


def _fit_roles(api: str, args: list, kwargs: dict, me: int) -> None:
    """gather and scatter take their list on the root rank only: fit the peer's role."""
    if api not in ("gather", "scatter"):
        return
    root_key = "dst" if api == "gather" else "src"
    root = kwargs.get(root_key, args[2] if len(args) > 2 else None)
    list_key = "gather_list" if api == "gather" else "scatter_list"
    if root != me:
        if list_key in kwargs:
            kwargs[list_key] = None
        elif len(args) > 1:
            args[1] = None


def complete_pending(calls: list[dict]) -> int:
    """Run each described collective (from a peer's history) with placeholder zeros on the
    peer's group, so that the peer, blocked in it, is freed. Returns how many ran."""
    done = 0
    for call in calls:
        group = c10d._resolve_process_group(call["group"])
        pos = call["group_pos"]
        args = [None if i == pos else _placeholder(a) for i, a in enumerate(call["args"])]
        kwargs = {k: None if k == "group" else _placeholder(v)
                  for k, v in call["kwargs"].items()}
        if "group" in kwargs or len(args) <= pos:
            kwargs["group"] = group if call["kind"] == "c10d" else call["group"]
        else:
            args[pos] = group if call["kind"] == "c10d" else call["group"]
        kwargs.pop("async_op", None)
        _fit_roles(call["api"], args, kwargs, dist.get_rank())
        module = c10d if call["kind"] == "c10d" else funcol
        result = getattr(module, call["api"])(*args, **kwargs)
        wait = getattr(result, "wait", None)
        if callable(wait):
            wait()
        elif call["kind"] == "funcol":
            funcol.wait_tensor(result)
        done += 1
    dist.distributed_c10d._get_default_group()  # still a working group afterwards
    return done
