"""N ranks inside the notebook's own process: `sim = tplab.simulate(4)`.

Built on torch's LocalTensorMode (`torch.distributed._local_tensor`) and the "fake" process
group (`torch.testing._internal.distributed.fake_pg.FakeStore`): every tensor holds one value
per rank (a LocalTensor), every op runs once per rank, and collectives are done exactly, by
arithmetic on those values. `sim.run(fn)` keeps the contract of `tplab.launch(...).run(fn)`:
item r is fn's result on rank r, tensors as CPU tensors, DTensors as `LocalShard`.

Limits (say them in a lesson that uses it):
- It rests on private torch APIs, which may change between torch releases.
- fn runs ONCE for all ranks. Python control flow on the rank (`if dist.get_rank() == 0`)
  cannot branch per rank: a rank-dependent value is a SymInt holding every rank's value,
  `==` on it is False unless all ranks agree, and `int()` on it fails. Keep rank-dependent
  work in tensor ops on tensors made inside fn (`torch.ones(n) * rank` works); a tensor
  made outside the simulation meets a per-rank number only through a tensor (index_select
  with `torch.arange(n) + rank * n`, as tplab.megatron does; `narrow` fails). Or use
  real processes.
- While fn runs, `dist.get_rank()` (no group) is replaced by one that gives that per-rank
  SymInt; for a sub-group use `mesh.get_local_rank("tp")`. A Python number taken from a
  tensor that differs per rank (`.item()`, `.tolist()`) fails: return the tensor, it comes
  back per rank.
- Random ops through the default generator start from the same state on every rank, but a
  random op on an explicit `torch.Generator` gives each rank different values: make inputs
  outside `run` (pass them as arguments) or with `tplab.models.make_input`.
- Adding a per-rank number straight to a tensor made outside fn (`t + dist.get_rank()`,
  `t - mesh.get_local_rank() * 2`) gives wrong values with no error (every rank's result
  is offset by a sentinel such as -7777777): turn the number into a tensor inside fn
  first, `t + (torch.zeros((), dtype=t.dtype) + rank)`, or use real processes.
- FSDP2 (`fully_shard`) does not run here (it resizes storages LocalTensor lacks).
- A few collectives differ from CPU processes: DTensor's Shard(i) -> Shard(j) is an
  all-to-all here, where gloo (no all-to-all) all-gathers instead.
- Ops that a DTensor plan leaves as AsyncCollectiveTensors are waited on before results
  come back. There is no timeout and no hang detection: a collective cannot hang here.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import time
import traceback
import types

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._local_tensor import (
    LocalIntNode,
    LocalTensor,
    LocalTensorMode,
    enabled_local_tensor_mode,
)
from torch.distributed.tensor import DTensor, _random
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

import tplab
from tplab import mesh
from tplab.core.output import format_rank_list
from tplab.core.pytrees import map_leaves
from tplab.core.transfer import LocalShard, describe_dtensor
from tplab.errors import LabError, PlanError, RankError, RankPlanError
from tplab.lab.arguments import check_ranks, check_timeout, check_world_size
from tplab.lab.time_limit import stop_after
from tplab.rank import torch_log


def simulate(world_size: int = 4) -> Simulation:
    """A simulated lab of `world_size` ranks in this process (same `.run` as `tplab.launch`)."""
    return Simulation(world_size)


class Simulation:
    """Runs fn once, SPMD over `world_size` simulated ranks; see the module docstring."""

    world_size: int
    backend = "simulated"
    in_process = True  # the ranks are this process (tplab/lab/contract.py, Ranks)
    threads_per_rank = None  # this process's own torch threads
    shared_dir = None  # nothing to share through files: the ranks see this process's objects

    def __init__(self, world_size: int = 4):
        self.world_size = check_world_size(world_size)
        self.pids: list[int] = []
        self._namespace: dict = {}
        self._only_on: dict[str, dict[int, object]] = {}  # names pushed to some ranks only
        self._closed = False
        self._ensure_process_group()

    def __repr__(self) -> str:
        return f"Simulation(world_size={self.world_size})"

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def closed(self) -> bool:
        """True once shut down (a simulation can still run: nothing was started)."""
        return self._closed

    @property
    def rank_pids(self) -> list[int]:
        """No rank processes: []."""
        return []

    def shutdown(self) -> None:
        """Nothing to stop: no processes were started."""
        self._closed = True

    @contextlib.contextmanager
    def time_limit(self, seconds: float):
        """The learner's own Python code in the block is stopped between bytecodes once
        `seconds` have passed (a TimeLimitReached; tplab/lab/time_limit.py): nobody else is
        there to interrupt it. Yields the limit (`.reached`)."""
        seconds = check_timeout(seconds, "time_limit")
        if seconds is None:
            raise ValueError("time_limit needs a positive number of seconds, got None")
        with stop_after(seconds) as limit:
            yield limit

    def restart(self) -> float:
        """Forget every name defined on the ranks (as fresh rank processes would)."""
        started = time.monotonic()
        self._namespace.clear()
        self._only_on.clear()
        return time.monotonic() - started

    def reload(self, module: types.ModuleType) -> types.ModuleType:
        """Reload an edited module (the ranks are this process: importlib.reload)."""
        if not isinstance(module, types.ModuleType):
            raise TypeError(f"sim.reload needs a module (import it first), got {module!r}")
        return importlib.reload(module)

    # --- the .run contract ---------------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = None, ranks=None,
            cell_timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank -> [result on rank 0, ..., rank n-1].

        `timeout` and `cell_timeout` are checked and accepted for parity (tplab's keywords,
        never fn's), and ignored: nothing here waits on another process. `ranks` selects
        which ranks' results come back; fn still runs once for all of them.
        """
        if not callable(fn):
            raise TypeError(f"sim.run needs a function as its first argument, got {fn!r}")
        check_timeout(timeout, "timeout")
        check_timeout(cell_timeout, "cell_timeout")
        ranks = check_ranks(ranks, self.world_size)
        return self._per_rank(self._call(fn, args, kwargs), ranks)

    def execute(self, code: str, timeout: float | None = None, ranks=None,
                cell_timeout: float | None = None) -> list:
        """Run a cell's code on every rank (what `%%ranks` calls) in a namespace kept between
        cells, holding torch, dist, tplab, world_size and rank (a per-rank SymInt);
        item r is the value of the cell's last expression on rank r."""
        if not isinstance(code, str):
            raise TypeError(f"sim.execute needs code as a string, got {type(code).__name__}")
        if not self._namespace:
            self._fill_namespace()
        tree = ast.parse(code, "<ranks cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None

        def cell():
            exec(compile(tree, "<ranks cell>", "exec"), self._namespace)
            if last is not None:
                return eval(compile(ast.Expression(last.value), "<ranks cell>", "eval"),
                            self._namespace)
            return None

        return self.run(cell, timeout=timeout, ranks=ranks, cell_timeout=cell_timeout)

    def push(self, mapping: dict, ranks=None) -> None:
        """Set names on every rank (or `ranks`). A name that only some ranks have is not
        visible to code, which runs on every rank at once here; `pull` has it per rank."""
        if not isinstance(mapping, dict):
            raise TypeError(f"sim.push needs a dict of name -> value, got {type(mapping).__name__}")
        bad = [k for k in mapping if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ValueError(f"sim.push needs names (identifiers) as keys, got {bad[0]!r}")
        targets = check_ranks(ranks, self.world_size)
        if not self._namespace:
            self._fill_namespace()
        for name, value in mapping.items():
            held = self._only_on.pop(name, None)
            if held is None:
                held = dict.fromkeys(range(self.world_size), self._namespace[name]) \
                    if name in self._namespace else {}
            held.update(dict.fromkeys(targets, value))
            values = list(held.values())
            if len(held) == self.world_size and all(v is values[0] for v in values):
                self._namespace[name] = values[0]  # every rank has the same: code sees it
            else:
                self._namespace.pop(name, None)
                self._only_on[name] = held

    def pull(self, name: str, ranks=None) -> list:
        if not isinstance(name, str):
            raise TypeError(f"sim.pull needs a name (a string), got {type(name).__name__}")
        ranks = check_ranks(ranks, self.world_size)
        if name in self._only_on:
            held = self._only_on[name]
            missing = [r for r in ranks if r not in held]
            if missing:
                raise LabError(f"name {name!r} is not defined on {format_rank_list(missing)}")
            return [held[r] for r in ranks]
        if name not in self._namespace:
            raise LabError(f"name {name!r} is not defined on {format_rank_list(ranks)}")
        return self._per_rank(self._namespace[name], ranks)

    def _fill_namespace(self) -> None:
        rank = self._call(lambda: dist.get_rank(), (), {})
        self._namespace.update(torch=torch, dist=dist, tplab=tplab, rank=rank,
                               world_size=self.world_size)

    # --- inside ---------------------------------------------------------------------------

    def _ensure_process_group(self) -> None:
        # one process has one default group: switch it when another world size is asked for
        if dist.is_initialized():
            if dist.get_backend() != "fake":
                raise LabError("this process already has a real process group "
                               f"({dist.get_backend()}); simulate needs a process without one")
            if dist.get_world_size() == self.world_size:
                return
            dist.destroy_process_group()
            _random._rng_tracker = None  # it remembers the old mesh
            mesh.forget_meshes()
        dist.init_process_group("fake", rank=0, world_size=self.world_size, store=FakeStore())

    def _call(self, fn, args, kwargs):
        self._ensure_process_group()
        log = None
        try:
            with torch_log.routed_to_file() as log, _rank_aware_get_rank() as get_rank, \
                    LocalTensorMode(self.world_size):
                fn = get_rank if fn is _GET_RANK else fn  # run(dist.get_rank) itself
                return _settle(fn(*args, **kwargs))
        except (Exception, SystemExit) as exc:  # as from rank processes (sys.exit too): a
            # RankError with every traceback; KeyboardInterrupt (the stop button) goes through
            tb = traceback.format_exc()
            if log is not None and log.wrote:
                tb += f"(torch's own log of this failure: {log.path})\n"
            name = type(exc).__name__
            # a PlanError stays one (as from rank processes: tplab/lab/watchdog.py)
            kind = RankPlanError if isinstance(exc, PlanError) else RankError
            raise kind({r: tb for r in range(self.world_size)}, self.world_size,
                       {r: name for r in range(self.world_size)}) from exc

    def _per_rank(self, out, ranks=None) -> list:
        ranks = range(self.world_size) if ranks is None else ranks
        return [_for_rank(out, r) for r in ranks]


_GET_RANK = dist.get_rank


@contextlib.contextmanager
def _rank_aware_get_rank():
    """`dist.get_rank()` answers for every simulated rank at once (a per-rank SymInt)."""
    original = _GET_RANK

    def get_rank(group=None):
        mode = enabled_local_tensor_mode()
        if mode is None:
            return original(group)
        if group is not None and group is not dist.GroupMember.WORLD:
            if dist.get_world_size(group) != dist.get_world_size():
                raise LabError("in tplab.simulate, dist.get_rank(group) is only known for the "
                               "whole world; use mesh.get_local_rank('tp') instead")
        return torch.SymInt(LocalIntNode({r: r for r in mode.ranks}))

    dist.get_rank = get_rank
    try:
        yield get_rank
    finally:
        dist.get_rank = original


class _DTensorResult:
    """A DTensor whose local value is settled (no AsyncCollectiveTensor left)."""

    def __init__(self, dt, local):
        self.dt, self.local = dt, local


def _settle(obj):
    """Wait on AsyncCollectiveTensors (RowwiseParallel outputs) while still in the mode."""
    return map_leaves(_settle_tensor, obj, _is_settle_leaf)


def _settle_tensor(t):
    if isinstance(t, DTensor):
        local = t._local_tensor
        if isinstance(local, AsyncCollectiveTensor):
            local = local.wait()
        return _DTensorResult(t, local)
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _rank_value(t, rank: int):
    if isinstance(t, LocalTensor):
        t = t._local_tensors[rank]
    return t.detach()


def _for_rank(obj, rank: int):
    """Rank `rank`'s view of a result: LocalTensor -> its tensor, SymInt -> its int, ...,
    inside dataclasses too (tplab's records, `StepResult` and `ParamLayout`, as a user's),
    as rank processes send them."""
    return map_leaves(lambda leaf: _leaf_for_rank(leaf, rank), obj, _is_result_leaf)


def _is_settle_leaf(obj) -> bool:
    return isinstance(obj, (torch.Tensor, LocalShard))


def _is_result_leaf(obj) -> bool:
    return isinstance(obj, (_DTensorResult, torch.Tensor, torch.SymInt, LocalShard))


def _leaf_for_rank(obj, rank: int):
    if isinstance(obj, _DTensorResult):
        dt = obj.dt
        mesh = dt.device_mesh
        coord = [int(c[0]) for c in (mesh.mesh == rank).nonzero(as_tuple=True)]
        _, offsets = _compute_local_shape_and_global_offset(
            dt.shape, mesh.shape, coord, dt.placements)
        shard = describe_dtensor(dt, rank, local=_rank_value(obj.local, rank))
        shard.coordinate = tuple(coord)
        shard.offsets = tuple(int(o) for o in offsets)
        return shard
    if isinstance(obj, torch.Tensor):
        return _rank_value(obj, rank)
    if isinstance(obj, torch.SymInt):
        node = obj.node
        if hasattr(node, "_local_ints"):
            return node._local_ints[rank]
        constant = node.maybe_as_int() if hasattr(node, "maybe_as_int") else None
        return constant if constant is not None else int(obj)  # e.g. a mesh dim of size 1
    return obj  # a LocalShard
