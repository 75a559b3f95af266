"""What one rank holds in memory during a step: `with tplab.memory() as m: ...`.

Four parts, as in the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3):

- parameters: the bytes of this rank's parameter storages (its shards under TP);
- gradients: the bytes of their `.grad` storages, read when the context exits;
- optimizer state: measured from `optimizer.state` when an optimizer is given, else Adam's
  two fp32 moments per parameter element (exp_avg and exp_avg_sq, `torch.optim.Adam`);
- activations: the tensors autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks`. Many saved tensors are views of one buffer
  (q, k and v of one linear; a linear's input saved by three linears), so what is counted
  is the distinct storages, told apart by `untyped_storage().data_ptr()` while they are
  alive, at `untyped_storage().nbytes()` each. A DTensor counts its local tensor. Storages
  that belong to parameters (a linear saves its weight) are left out.

Each saved storage is charged to the innermost module whose forward was running when it
was first saved (module hooks, as in `tplab.trace`); `rows` are those totals by module
path. `peak_bytes` is the most saved bytes alive at once: autograd drops a saved tensor
when its node has run in backward, so the peak is usually the end of the forward pass.

Under `tplab.simulate` every simulated rank is counted on its own (a LocalTensor's
per-rank tensors); a number that differs between ranks is a per-rank SymInt, which
`sim.run` hands back as one int per rank, like everything else it returns.

Contexts nest, as `tplab.trace()` does: each open `tplab.memory()` counts every tensor saved
while it is open, so an outer context includes what was saved inside an inner one (also when
they only overlap: `a` opened, `b` opened, `a` closed, `b` closed). torch runs only the
innermost pair of saved-tensor hooks, so one pair serves every open context (`_OPEN`).

Activation checkpointing (`torch.utils.checkpoint`, `checkpoint_wrapper`): what a
checkpointed region keeps for backward is its inputs (the non-reentrant checkpoint saves them
through a no-op autograd Function, the reentrant one through `save_for_backward`), counted as
any saved tensor and charged to the module running when the checkpoint was entered (the
`CheckpointWrapper`, for `checkpoint_wrapper`); what it saves inside is not kept. Backward
runs the region's forward again and saves its tensors once more, for a moment: storages that
first appear while backward runs are `recomputed_bytes`, by module in `recomputed_rows` (not
in `activation_bytes` nor `rows`, which are what the forward pass leaves for backward), and
they count in `peak_bytes`, all alive at the end of the recomputation. The non-reentrant
checkpoint recomputes under saved-tensor hooks of its own; tplab's pair goes on top of them
for the region's modules and hands every tensor on to torch's.

Limits: a parameter used outside any module's forward is only recognised when the model is
passed (`tplab.memory(model)`); a double backward's saved tensors count as recomputed; the
open contexts are the process's (backward may run on a thread of autograd's own), so two
threads that each open one at the same time count each other's saved tensors.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalIntNode
from torch.nn.modules.module import register_module_forward_pre_hook

ADAM_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32 each, per parameter element


# The memory contexts open in this process, oldest first. Not one list per thread: torch's
# saved-tensor hooks travel with autograd's thread-local state into the threads that run
# backward (on CUDA, a device thread of autograd's own), and a checkpoint's recomputation
# saves its tensors there; a per-thread list was empty there (recomputed 0 on an H200).
_OPEN: list[Memory] = []


def _pack_all(tensor):
    """The saved-tensor hook every open context shares: each one counts the tensor."""
    return _Packed(tensor, [(m, m._pack(tensor)) for m in list(_OPEN)])


def _unpack(packed):
    return packed.tensor


def _handing_on(pack, unpack):
    """A pair that counts a tensor in every open context, then hands it to the pair it
    covers (a non-reentrant checkpoint's recomputation hooks) and back."""
    def pack_on(tensor):
        # counted first: torch's pack stops the recomputation (an exception) once it has
        # saved the last tensor backward needs, and that one is saved all the same
        counted = _Packed(None, [(m, m._pack(tensor)) for m in list(_OPEN)])
        counted.tensor = pack(tensor)
        return counted

    def unpack_on(packed):
        return unpack(packed.tensor)

    pack_on.tplab_memory = True
    return pack_on, unpack_on


def _ours_on_top() -> bool:
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is None or top[0] is _pack_all or getattr(top[0], "tplab_memory", False)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _local_mode():
    lt = sys.modules.get("torch.distributed._local_tensor")
    return lt.local_tensor_mode() if lt is not None else None


class _Ranks:
    """The ranks this process speaks for: one (a rank process) or all (tplab.simulate)."""

    def __init__(self):
        mode = _local_mode()
        self.simulated = mode is not None
        self.ranks = sorted(mode.ranks) if mode is not None else [0]
        # DTensor and AsyncCollectiveTensor wrap a local tensor; without their modules
        # imported there can be none (and importing DTensor costs seconds)
        found = (getattr(sys.modules.get(module), name, None) for module, name in (
            ("torch.distributed.tensor", "DTensor"),
            ("torch.distributed._functional_collectives", "AsyncCollectiveTensor")))
        self._wrappers = tuple(cls for cls in found if cls is not None)
        self._plain = (torch.Tensor, nn.Parameter)

    def locals(self, t: torch.Tensor) -> dict[int, torch.Tensor]:
        """{rank: the plain tensor that rank holds} for a tensor, DTensor or LocalTensor."""
        if type(t) in self._plain:   # the common case, first
            return dict.fromkeys(self.ranks, t)
        while self._wrappers and isinstance(t, self._wrappers):
            t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
        per_rank = getattr(t, "_local_tensors", None)   # a LocalTensor (tplab.simulate)
        if per_rank is not None:
            return dict(per_rank)
        return dict.fromkeys(self.ranks, t)

    def value(self, per_rank: dict[int, int]):
        """An int when every rank agrees, else a per-rank SymInt (tplab.simulate)."""
        values = [per_rank.get(r, 0) for r in self.ranks]
        if len(set(values)) == 1:
            return values[0]
        return torch.SymInt(LocalIntNode(dict(zip(self.ranks, values, strict=True))))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(data_ptr, nbytes) of the storage under `t`; (0, 0) for a tensor without one
    (sparse, or a tensor subclass that holds no data of its own)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


def storage_bytes(tensors, ranks: _Ranks) -> dict[int, int]:
    """{rank: bytes of the distinct storages of `tensors`} (each counted once per rank)."""
    seen: dict[int, dict[int, int]] = {r: {} for r in ranks.ranks}
    for t in tensors:
        if t is None:
            continue
        for r, local in ranks.locals(t).items():
            ptr, nbytes = _storage_key(local)
            if nbytes:
                seen.setdefault(r, {})[ptr] = nbytes
    return {r: sum(s.values()) for r, s in seen.items()}


class _Packed:
    """What autograd keeps instead of a saved tensor; when autograd drops it (its node ran
    in backward), the storages it held are released in the count of every context that
    counted them: `counts` is [(context, its keys for this tensor)]."""

    __slots__ = ("tensor", "counts")

    def __init__(self, tensor, counts=()):
        self.tensor, self.counts = tensor, counts

    def __del__(self):
        for owner, keys in self.counts:
            if keys:
                owner._release(keys)


class Memory:
    """The context manager `tplab.memory()` returns; see the module docstring."""

    def __init__(self, model: nn.Module | None = None, optimizer=None):
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"tplab.memory(model): model must be an nn.Module, got "
                            f"{type(model).__name__}")
        if optimizer is not None and not hasattr(optimizer, "state"):
            raise TypeError("tplab.memory(optimizer=...): expected a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.activation_bytes = self.peak_bytes = self.recomputed_bytes = 0
        self.param_bytes = self.grad_bytes = self.optimizer_bytes = 0
        self.rows: list[dict] = []
        self.recomputed_rows: list[dict] = []
        self._handles: list = []

    # --- entering and leaving -------------------------------------------------------------

    def __enter__(self) -> Memory:
        if self in _OPEN:
            raise RuntimeError("this tplab.memory() context is already open; nest a new "
                               "one instead: with tplab.memory() as inner: ...")

        self._ranks = _Ranks()
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._hooked: set[int] = set()
        self._params: dict[int, nn.Parameter] = {}
        self._param_ptrs: dict[int, set[int]] = {r: set() for r in self._ranks.ranks}
        self._live: dict[tuple[int, int], list] = {}  # (rank, ptr) -> [nbytes, refs]
        self._live_bytes = dict.fromkeys(self._ranks.ranks, 0)
        self._peak = dict.fromkeys(self._ranks.ranks, 0)
        self._by_module: dict[str, dict[int, list[int]]] = {}  # path -> rank -> [bytes, n]
        self._recomputed: dict[str, dict[int, list[int]]] = {}  # the same, in backward
        self._again: list[tuple[str, bool]] = []  # modules re-run in backward: path, pushed
        if self.model is not None:
            self._root(self.model)
        self._handles.append(register_module_forward_pre_hook(self._pre))
        # Every context pushes the same shared pair, so whichever pair an overlapping
        # context pops, the one left serves the contexts still open.
        self._saved = torch.autograd.graph.saved_tensors_hooks(_pack_all, _unpack)
        self._saved.__enter__()
        _OPEN.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _OPEN:
            _OPEN.remove(self)
        self._saved.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        ranks = self._ranks
        params = list(self._params.values())
        self.param_bytes = ranks.value(storage_bytes(params, ranks))
        self.grad_bytes = ranks.value(storage_bytes([p.grad for p in params], ranks))
        if self.optimizer is not None:
            state = [v for s in self.optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
            self.optimizer_bytes = ranks.value(storage_bytes(state, ranks))
        else:
            numel = dict.fromkeys(ranks.ranks, 0)
            for p in params:
                for r, local in ranks.locals(p).items():
                    numel[r] += local.numel()
            self.optimizer_bytes = ranks.value({r: ADAM_STATE_BYTES * n
                                                for r, n in numel.items()})
        self.peak_bytes = ranks.value(self._peak)
        self.rows, self.activation_bytes = self._table(self._by_module)
        self.recomputed_rows, self.recomputed_bytes = self._table(self._recomputed)

    def _table(self, by_module) -> tuple[list[dict], object]:
        """(rows, total bytes) of {path: {rank: [bytes, storages]}}."""
        ranks, rows = self._ranks, []
        totals = dict.fromkeys(ranks.ranks, 0)
        for path, per_rank in by_module.items():
            for r, (nbytes, _) in per_rank.items():
                totals[r] += nbytes
            rows.append({
                "module": path,
                "bytes": ranks.value({r: v[0] for r, v in per_rank.items()}),
                "storages": ranks.value({r: v[1] for r, v in per_rank.items()})})
        return rows, ranks.value(totals)

    def summary(self) -> dict:
        """The numbers as a plain dict (what to return from a rank)."""
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes,
                "activation_bytes": self.activation_bytes, "peak_bytes": self.peak_bytes,
                "rows": self.rows, "recomputed_bytes": self.recomputed_bytes,
                "recomputed_rows": self.recomputed_rows}

    # --- modules: which one is running, and its parameters ----------------------------------

    def _root(self, module) -> None:
        """A module not seen yet is a root: paths from it, and all its parameters."""
        for path, m in module.named_modules():
            self._names.setdefault(id(m), path)
        self._add_params(module.parameters())

    def _add_params(self, params) -> None:
        for p in params:
            if id(p) in self._params:
                continue
            self._params[id(p)] = p
            for r, local in self._ranks.locals(p).items():
                self._param_ptrs.setdefault(r, set()).add(_storage_key(local)[0])

    def _pre(self, module, args):
        if _in_backward():   # a forward re-run inside backward: a checkpoint's recomputation
            push = not _ours_on_top()
            if push:
                torch._C._autograd._push_saved_tensors_default_hooks(*_handing_on(
                    *torch._C._autograd._top_saved_tensors_default_hooks(True)))
            self._again.append((self._names.get(id(module), ""), push))
            return
        if id(module) not in self._names:
            self._root(module)
        self._stack.append(self._names[id(module)])
        if id(module) not in self._hooked:
            # registered after parallelize_module's own hooks, so it pops after them
            self._hooked.add(id(module))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def _post(self, module, args, output):
        if not _in_backward():
            if self._stack:
                self._stack.pop()
        elif self._again:
            if self._again.pop()[1]:
                torch._C._autograd._pop_saved_tensors_default_hooks()

    # --- saved tensors --------------------------------------------------------------------

    def _pack(self, tensor) -> list:
        """Count a tensor autograd saves; returns the (rank, storage) keys it holds."""
        keys = []
        again = _in_backward()
        if again:
            path = self._again[-1][0] if self._again else ""
        else:
            path = self._stack[-1] if self._stack else ""
        by_module = self._recomputed if again else self._by_module
        for r, local in self._ranks.locals(tensor).items():
            ptr, nbytes = _storage_key(local)
            if not nbytes or ptr in self._param_ptrs.get(r, ()):
                continue
            key = (r, ptr)
            entry = self._live.get(key)
            if entry is None:   # a storage not alive in the count yet: a new one
                entry = self._live[key] = [nbytes, 0]
                self._live_bytes[r] += nbytes
                self._peak[r] = max(self._peak[r], self._live_bytes[r])
                row = by_module.setdefault(path, {}).setdefault(r, [0, 0])
                row[0] += nbytes
                row[1] += 1
            entry[1] += 1
            keys.append(key)
        return keys

    def _release(self, keys) -> None:
        for key in keys:
            entry = self._live.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[key]
                self._live_bytes[key[0]] -= entry[0]


def memory(model: nn.Module | None = None, optimizer=None) -> Memory:
    """A context manager that measures this rank's memory during a step (module doc).

    `model`: whose parameters, gradients and optimizer state to count (default: every model
    whose forward runs inside the context, with all its submodules). `optimizer`: measure
    its state; without one, Adam's 8 bytes per parameter element are assumed.
    """
    return Memory(model, optimizer)
