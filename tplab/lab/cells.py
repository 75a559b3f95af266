"""What a cell is, on a Lab: `run`, `execute`, `push` and `pull`, each one request to the
ranks watched by the Watchdog until every rank answered (docs/DESIGN.md, "Cells")."""

from __future__ import annotations

import sys

import cloudpickle

from tplab.errors import LabError
from tplab.lab import rank as rank_side
from tplab.lab.displays import show_rank_displays
from tplab.lab.names import payload_for_run
from tplab.lab.results import RankResults
from tplab.lab.validate import check_ranks, check_timeout


class Cells:
    """The work half of `tplab.Lab` (launch.py has the processes' life)."""

    def run(self, fn, *args, timeout: float | None = None, ranks=None,
            cell_timeout: float | None = None, **kwargs) -> list:
        """Call fn(*args, **kwargs) on every rank (or on `ranks`, in that order); item i is
        the result of the i-th rank asked. A function defined in the notebook runs with the
        rank's namespace as its globals: the rank's own names (rank, world_size, pushed
        values...) win over the notebook's, and `global` assignments stay on the rank."""
        if not callable(fn):
            raise TypeError(f"lab.run needs a function as its first argument, got {fn!r}")
        timeout = check_timeout(timeout, "timeout")
        cell_timeout = check_timeout(cell_timeout, "cell_timeout")
        targets = check_ranks(ranks, self.world_size)
        payload = payload_for_run(fn, args, kwargs, self.names.known(targets))
        return self._dispatch(rank_side.call_pickled, payload, timeout, targets, cell_timeout)

    def execute(self, code: str, timeout: float | None = None, ranks=None,
                cell_timeout: float | None = None) -> list:
        """Run code on every rank (what %%ranks does); item r is the last expression's value."""
        if not isinstance(code, str):
            raise TypeError(f"lab.execute needs code as a string, got {type(code).__name__}")
        timeout = check_timeout(timeout, "timeout")
        cell_timeout = check_timeout(cell_timeout, "cell_timeout")
        targets = check_ranks(ranks, self.world_size)
        return self._dispatch(rank_side.execute, code, timeout, targets, cell_timeout)

    def push(self, mapping: dict, ranks=None) -> None:
        """Set names in every rank's namespace (they are the ranks' own names from then on)."""
        if not isinstance(mapping, dict):
            raise TypeError(f"lab.push needs a dict of name -> value, got {type(mapping).__name__}")
        bad = [k for k in mapping if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ValueError(f"lab.push needs names (identifiers) as keys, got {bad[0]!r}")
        targets = check_ranks(ranks, self.world_size)
        payload = self._dumps(mapping, "a value pushed")
        self._dispatch(rank_side.push_pickled, payload, None, targets)

    def pull(self, name: str, ranks=None) -> list:
        """The value of `name` on every rank; a LabError names the ranks that lack it."""
        if not isinstance(name, str):
            raise TypeError(f"lab.pull needs a name (a string), got {type(name).__name__}")
        targets = check_ranks(ranks, self.world_size)
        results = self._dispatch(rank_side.pull, name, None, targets)
        missing = [r for r, v in zip(targets, results, strict=True)
                   if isinstance(v, rank_side.Missing)]
        if missing:
            from tplab.lab.output import format_rank_list

            raise LabError(f"name {name!r} is not defined on {format_rank_list(missing)}")
        return results

    def _send(self, ranks: list[int], remote_fn, *args):
        """A request to some ranks, outside a cell's watch (the watchdog uses it)."""
        view = self._client.direct_view([self._engine_ids[r] for r in ranks])
        return view.apply_async(remote_fn, *args, next(self._cells))

    def _dispatch(self, remote_fn, payload, timeout, targets: list[int],
                  cell_timeout: float | None = None) -> list:
        self._check_open()
        if self._broken:
            print(f"[tplab] {self._broken}: restarting the ranks first (names defined on them "
                  "are gone)", file=sys.stderr, flush=True)
            self._restart_ranks()
        cell = next(self._cells)
        if len(targets) < self.world_size:
            view = self._client.direct_view([self._engine_ids[r] for r in targets])
        else:
            if self._view is None:  # made once per set of rank processes
                self._view = self._client.direct_view(self._engine_ids)
            view = self._view
        ar = view.apply_async(remote_fn, payload, cell)  # one request for all ranks
        order = targets if len(targets) < self.world_size else list(range(self.world_size))
        generation = self._generation
        res = RankResults(ar, order)
        try:
            results = self.watchdog.wait(res, cell, timeout or self.timeout,
                                         cell_timeout or self.cell_timeout)
        finally:
            if generation == self._generation:  # not after a restart: those names are gone
                self.names.learn({r: res.reply(r) for r in res.finished()})
                show_rank_displays(ar, order, res.finished())  # what ranks display(...)ed
        by_rank = dict(zip(order, results, strict=True))
        return [by_rank[r] for r in targets]

    def _dumps(self, obj, what: str) -> bytes:
        try:
            return cloudpickle.dumps(obj)
        except Exception as exc:
            raise TypeError(f"{what} cannot be sent to the ranks: {type(exc).__name__}: {exc}. "
                            "Define it in the notebook or an importable module, and pass "
                            "plain data (tensors, numbers, lists) as arguments.") from exc
