"""Record every collective a rank issues: `with tplab.trace() as t: ...; t.counts()`.

Built on torch's dispatcher, like DTensor's CommDebugMode: a TorchDispatchMode sees each
collective op as it is dispatched, both DTensor's functional collectives
(`_c10d_functional.all_reduce`, ...) and plain `torch.distributed` calls (`c10d.allreduce_`,
...), so the hand-written f and g of `tplab.megatron` show up too. Unlike CommDebugMode it
keeps one record per call, with the message size and the time: a `CollectiveRecord`
(tplab/core/records.py: a frozen record read by key as the dicts it replaced, `r["op"]`),
which travels back to the notebook by pickle.

Each record's `cause` says why it ran (tplab.causes): the placements of a DTensor
redistribution, the tplab.megatron operator ("f", "g", ...), or the user's line of code;
`t.explain()` is a table of them with each collective's conjugate in the other pass.

The module path comes from module hooks: the innermost module whose forward is running
(including its own hooks, where parallelize_module redistributes outputs), and in the
backward pass the innermost module whose gradients are being computed, except for a
collective in a hand-written autograd Function's backward: it belongs to the module that
read the Function's output in the forward pass (f's all-reduce to the layer f guards).

Timing: `duration_ms` of a functional collective runs from its issue to its wait (DTensor
waits lazily, so this includes any compute it overlapped); a c10d call is waited on by the
trace itself (so an async_op=True call becomes synchronous while traced). On CUDA these are
host-side times. Send and recv are not waited on (that could deadlock a pair of ranks).
`start_ms` is when the call was issued, from the trace's start: the gap from one record's
start + duration to the next one's start is the compute between them.

Cost (measured, CPU, benchmarks/trace_overhead.py): every op of a traced step, not only the
collectives, passes through `__torch_dispatch__` in Python. torch's own round trip into a
mode is about 5 us per op (more on busy ranks) and is most of the overhead; this mode adds
little to it: a namespace check for ops that are not collectives. The module hooks cost
about 40 us per module call. A c10d collective also pays about 25 us to be re-issued
from Python (its ProcessGroup argument is a TorchScript object). Each collective's cause is
read from the Python stack (tplab.causes), a walk of a few dozen frames per collective; on the
DTensor block step, tracing with causes took 1.10x-1.28x the untraced step on a loaded
machine (benchmarks/grad_check.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, Work
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from tplab.causes import find_cause
from tplab.core import ops
from tplab.core.records import CollectiveRecord
from tplab.explain import explain
from tplab.mesh import GROUP_NAMES

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional


def _numel(t) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else sum(_numel(x) for x in t)


def _first(t):
    return t if isinstance(t, torch.Tensor) else _first(t[0])


# What each collective sends. Each entry: normalised op name, and a function
# (args, group_size) -> (the tensor that sets shape and dtype, message numel, shape).
def _same(i):
    def message(args, n):
        t = _first(args[i])
        return t, _numel(args[i]), list(t.shape)
    return message


def _times_n(i):
    # an all-gather's message is the gathered output (a scatter's the input on its root):
    # n times this rank's piece
    def message(args, n):
        t = _first(args[i])
        return t, _numel(args[i]) * n, [t.shape[0] * n, *t.shape[1:]] if t.ndim else [n]
    return message


# torch op -> (its name in the table `tplab.core.ops`, its message and bytes)
_OPS = {
    _funcol.all_reduce: (ops.ALL_REDUCE, _same(0)),
    _funcol.all_reduce_: (ops.ALL_REDUCE, _same(0)),
    _funcol.all_reduce_coalesced: (ops.ALL_REDUCE, _same(0)),
    _funcol.all_reduce_coalesced_: (ops.ALL_REDUCE, _same(0)),
    _funcol.all_gather_into_tensor: (ops.ALL_GATHER, _times_n(0)),
    _funcol.all_gather_into_tensor_out: (ops.ALL_GATHER, _times_n(0)),
    _funcol.all_gather_into_tensor_coalesced: (ops.ALL_GATHER, _times_n(0)),
    _funcol.reduce_scatter_tensor: (ops.REDUCE_SCATTER, _same(0)),
    _funcol.reduce_scatter_tensor_out: (ops.REDUCE_SCATTER, _same(0)),
    _funcol.reduce_scatter_tensor_coalesced: (ops.REDUCE_SCATTER, _same(0)),
    _funcol.all_to_all_single: (ops.ALL_TO_ALL, _same(0)),
    _funcol.broadcast: (ops.BROADCAST, _same(0)),
    _funcol.broadcast_: (ops.BROADCAST, _same(0)),
    torch.ops._dtensor.shard_dim_alltoall: (ops.ALL_TO_ALL, _same(0)),
    _c10d.allreduce_: (ops.ALL_REDUCE, _same(0)),
    _c10d.allreduce_coalesced_: (ops.ALL_REDUCE, _same(0)),
    _c10d.allgather_: (ops.ALL_GATHER, _times_n(1)),
    _c10d._allgather_base_: (ops.ALL_GATHER, _times_n(1)),
    _c10d.allgather_coalesced_: (ops.ALL_GATHER, _times_n(1)),
    _c10d.allgather_into_tensor_coalesced_: (ops.ALL_GATHER, _times_n(1)),
    _c10d.reduce_scatter_: (ops.REDUCE_SCATTER, _same(1)),
    _c10d._reduce_scatter_base_: (ops.REDUCE_SCATTER, _same(1)),
    _c10d.reduce_scatter_tensor_coalesced_: (ops.REDUCE_SCATTER, _same(1)),
    _c10d.alltoall_: (ops.ALL_TO_ALL, _same(1)),
    _c10d.alltoall_base_: (ops.ALL_TO_ALL, _same(1)),
    _c10d.broadcast_: (ops.BROADCAST, _same(0)),
    _c10d.reduce_: (ops.REDUCE, _same(0)),
    _c10d.gather_: (ops.GATHER, _times_n(1)),
    _c10d.scatter_: (ops.SCATTER, _times_n(0)),
    _c10d.send: (ops.SEND, _same(0)),
    _c10d.recv_: (ops.RECV, _same(0)),
    _c10d.recv_any_source_: (ops.RECV, _same(0)),
    _c10d.barrier: (ops.BARRIER, lambda args, n: (args[0], 0, [])),
    _c10d.monitored_barrier_: (ops.BARRIER, lambda args, n: (args[0], 0, [])),
}
_NO_WAIT = {ops.SEND, ops.RECV}
# every op above lives in one of these: the rest (aten, ...) pass through on a fast path
_NAMESPACES = frozenset(packet._qualified_op_name.partition("::")[0] for packet in _OPS)


def _group_of(func, args):
    """The ProcessGroup a collective runs on: a ScriptObject arg (c10d) or a name (funcol)."""
    if func.namespace == "c10d":
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    return ProcessGroup.unbox(a)
                except Exception:  # a ReduceOp, not the group
                    continue
        return None
    group = args[-1]
    if isinstance(group, str):
        return _resolve_process_group(group)
    return ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group


def _group_label(pg) -> str:
    """Mesh dim name ("tp", "dp") for groups of tplab meshes or DeviceMesh's group
    description, else "world" or the group's own description."""
    if pg is None:
        return "?"
    if pg.group_name in GROUP_NAMES:
        return GROUP_NAMES[pg.group_name]
    desc = getattr(pg, "group_desc", "") or ""
    if desc.startswith("mesh_"):
        return desc.removeprefix("mesh_")
    if pg is dist.distributed_c10d._get_default_group() or desc == "default_pg":
        return "world"
    return desc or f"group {pg.group_name}"


def _wait_work(out) -> None:
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, torch.ScriptObject):
            Work.unbox(o).wait()


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


class _Modules:
    """Which module is running: forward via module hooks, backward via gradient hooks."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.forward: list[str] = []
        self.backward: list[str] = []
        self.handles: list = []
        self.hooked: set[int] = set()
        # a hand-written autograd Function's node -> the modules that read its output:
        # its backward collective belongs to them (f guards w1's input), not to whichever
        # module's gradients are being computed when it runs
        self.readers: dict[int, tuple[object, list[str]]] = {}

    def __enter__(self):
        self.handles.append(register_module_forward_pre_hook(self._pre))
        return self

    def __exit__(self, *exc):
        # gradient hooks on a leaf (the input) outlive the step: remove them all
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.hooked.clear()
        self.readers.clear()
        self.forward.clear()
        self.backward.clear()

    def current(self, backward: bool) -> str:
        if not backward:
            return self.forward[-1] if self.forward else ""
        # the deepest active module, then the latest: a module and its last child share an
        # output tensor, so both enter at once
        return max(reversed(self.backward), key=_depth, default="")

    def _name(self, module) -> str:
        if id(module) not in self.names:  # the first module seen is the root: paths from it
            for path, m in module.named_modules():
                self.names.setdefault(id(m), path)
        return self.names[id(module)]

    def _pre(self, module, args):
        if torch._C._current_graph_task_id() != -1:
            return  # a forward re-run inside backward (activation checkpointing)
        name = self._name(module)
        self.forward.append(name)
        if id(module) not in self.hooked:
            # a module-local hook registered after parallelize_module's: it pops AFTER the
            # module's own output hooks, where DTensor plans issue their collectives
            self.hooked.add(id(module))
            self.handles.append(module.register_forward_hook(self._post, always_call=True))
        if torch.is_grad_enabled():
            tensors = _needs_grad(args)
            for t in tensors:
                node = t.grad_fn
                if isinstance(node, torch.autograd.function.BackwardCFunction):
                    if len(self.readers) > 4096:  # forward passes with no backward
                        self.readers.clear()
                    self.readers.setdefault(id(node), (node, []))[1].append(name)
            self._on_grads(tensors, self._leave(name), "all")

    def reader(self, node) -> str | None:
        """The module whose input `node`'s output is (their common parent if several)."""
        entry = self.readers.get(id(node)) if node is not None else None
        if entry is None or entry[0] is not node:
            return None
        names = [n.split(".") if n else [] for n in entry[1]]
        common = names[0]
        for other in names[1:]:
            k = 0
            while k < min(len(common), len(other)) and common[k] == other[k]:
                k += 1
            common = common[:k]
        return ".".join(common)

    def _post(self, module, args, output):
        if torch._C._current_graph_task_id() != -1 or not self.forward:
            return
        name = self.forward.pop()
        if torch.is_grad_enabled():
            self._on_grads(_needs_grad(output), self._enter(name), "any")

    def _on_grads(self, tensors, fn, mode):
        # one tensor (the usual case): a plain tensor hook, much cheaper than a multi-grad hook
        if len(tensors) == 1:
            self.handles.append(tensors[0].register_hook(fn))
        elif tensors:
            self.handles.append(torch.autograd.graph.register_multi_grad_hook(tensors, fn,
                                                                               mode=mode))

    def _enter(self, name):
        def hook(*grads):
            if not self.backward:  # forget modules whose inputs needed no gradient
                torch.autograd.Variable._execution_engine.queue_callback(self.backward.clear)
            self.backward.append(name)
        return hook

    def _leave(self, name):
        def hook(*grads):
            if name in self.backward:
                del self.backward[len(self.backward) - 1 - self.backward[::-1].index(name)]
        return hook


def _needs_grad(value) -> list:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class Trace(TorchDispatchMode):
    """The context manager `tplab.trace()` returns; `records` fill in as collectives run."""

    def __init__(self):
        super().__init__()
        self._defer = frozenset((DTensor, AsyncCollectiveTensor))
        self.records: list[CollectiveRecord] = []
        self._pending: dict[int, tuple[dict, float, torch.Tensor]] = {}
        self._groups: dict[str | None, tuple[str, int]] = {}
        self._modules = _Modules()

    def __enter__(self):
        self.records.clear()
        self._t0 = time.perf_counter()
        # in tplab.simulate this is a SymInt holding every rank: records split per rank
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._modules.__exit__(*exc)
        self._pending.clear()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless this says
        # False: about 1 us on every op, and nothing in a trace is compiled
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # let DTensor (and AsyncCollectiveTensor) desugar first; their collectives and waits
        # then come back through this mode (CommDebugMode does the same)
        if types and not self._defer.isdisjoint(types):
            return NotImplemented
        # every op of the step comes through here: the common case first, with no Python
        # __hash__ of the op (OpOverload defines one) and no kwargs dict
        if func.namespace not in _NAMESPACES:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        packet = func._overloadpacket
        spec = _OPS.get(packet)
        if spec is None:
            if packet is _funcol.wait_tensor:
                self._waited(args[0])
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        record = self._record(func, spec, args, (start - self._t0) * 1e3)
        if func.namespace == "c10d" and record.op not in _NO_WAIT:
            _wait_work(out)
        self._took(record.seq, start)
        if func.namespace != "c10d":  # functional: the wait comes later (wait_tensor)
            for t in out if isinstance(out, (list, tuple)) else (out,):
                self._pending[id(t)] = (record.seq, start, t)
        return out

    def _took(self, seq: int, start: float) -> None:
        """Record `seq` took from `start` until now (a frozen record: replaced)."""
        self.records[seq] = replace(self.records[seq],
                                    duration_ms=(time.perf_counter() - start) * 1e3)

    def _waited(self, t) -> None:
        pending = self._pending.pop(id(t), None)
        if pending is not None:
            seq, start, _ = pending
            self._took(seq, start)

    def _record(self, func, spec, args, start_ms: float) -> CollectiveRecord:
        op, message = spec
        pg = _group_of(func, args)
        key = pg.group_name if pg is not None else None  # not id(): unbox makes new wrappers
        if key not in self._groups:
            self._groups[key] = (_group_label(pg), pg.size() if pg is not None else 1)
        label, size = self._groups[key]
        tensor, numel, shape = message(args, size)
        backward = torch._C._current_graph_task_id() != -1
        cause, node = find_cause()
        module = self._modules.reader(node) if backward else None
        record = CollectiveRecord(
            rank=self._rank, seq=len(self.records), phase="backward" if backward else "forward",
            module=self._modules.current(backward) if module is None else module, op=op,
            shape=shape, dtype=str(tensor.dtype).removeprefix("torch."),
            bytes=numel * tensor.element_size(), group=label, group_size=size,
            start_ms=start_ms, cause=cause)
        self.records.append(record)
        return record

    def counts(self) -> dict[str, dict[str, int]]:
        """{"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}."""
        out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
        for r in self.records:
            phase = out[r["phase"]]
            phase[r["op"]] = phase.get(r["op"], 0) + 1
        return out

    def explain(self):
        """A table, one row per collective: phase, module, op, bytes, cause, and the
        conjugate collective in the other pass (`tplab.causes`)."""
        return explain(self.records)

    def bytes(self) -> dict[str, dict[str, int]]:
        """Total message bytes per phase and op, in the same shape as counts()."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for r in self.records:
            out[r["phase"]][r["op"]] = out[r["phase"]].get(r["op"], 0) + r["bytes"]
        return {"forward": dict(out["forward"]), "backward": dict(out["backward"])}


def trace() -> Trace:
    """A context manager that records every collective this rank issues (see module doc)."""
    return Trace()
