"""What a cell is, on a Lab: `run`, `execute`, `push` and `pull`, each one request to the
ranks watched by the Watchdog until every rank answered (docs/DESIGN.md, "Cells"); and
`reload`, an edited module loaded anew on the ranks."""

from __future__ import annotations

import importlib
import itertools
import sys
import types

import cloudpickle

from tplab.errors import LabError, RankError
from tplab.lab import modules
from tplab.lab.cluster import LabProcesses
from tplab.lab.displays import show_rank_displays
from tplab.lab.names import RankNames, payload_for_run
from tplab.lab.results import RankResults
from tplab.lab.validate import check_ranks, check_timeout
from tplab.lab.watchdog import Watchdog
from tplab.output import format_rank_list
from tplab.rank import runner as rank_side

PATHS_TIMEOUT_S = 30.0


class Cells:
    """The work half of `tplab.Lab` (launch.py has the processes' life). What it uses of
    the lab is declared here, and set by Lab.__init__ and Lab._init_ranks."""

    world_size: int
    timeout: float  # the hang limit of a cell (seconds all unfinished ranks wait, none computing)
    cell_timeout: float | None  # a wall-clock limit of a cell, off by default
    names: RankNames  # which names each rank defines itself
    processes: LabProcesses  # the ranks: client, engine ids, hosts
    watchdog: Watchdog  # waits for a cell (live output, hangs, deaths)
    _cells: itertools.count  # the number of the next request to the ranks
    _generation: int  # which start of the ranks is running (a restart makes a new one)
    _view: object  # a DirectView on every rank, made once per set of ranks (or None)
    _broken: str  # why the ranks need a restart before the next cell (or "")
    _paths_sent: tuple | None  # the notebook's sys.path as the ranks last got it
    _paths_absent: dict  # rank -> folders of that path its host does not have

    def _check_open(self) -> None:
        raise NotImplementedError  # Lab's: a LabError once the lab was shut down

    def _restart_ranks(self) -> float:
        raise NotImplementedError  # Lab's: fresh ranks, returns seconds

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
        try:
            return self._dispatch(rank_side.call_pickled, payload, timeout, targets,
                                  cell_timeout, fn)
        except RankError as error:
            self._explain_missing_module(error)
            raise

    def execute(self, code: str, timeout: float | None = None, ranks=None,
                cell_timeout: float | None = None) -> list:
        """Run code on every rank (what %%ranks does); item r is the last expression's value."""
        if not isinstance(code, str):
            raise TypeError(f"lab.execute needs code as a string, got {type(code).__name__}")
        timeout = check_timeout(timeout, "timeout")
        cell_timeout = check_timeout(cell_timeout, "cell_timeout")
        targets = check_ranks(ranks, self.world_size)
        try:
            return self._dispatch(rank_side.execute, code, timeout, targets, cell_timeout)
        except RankError as error:
            self._explain_missing_module(error)
            raise

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
            raise LabError(f"name {name!r} is not defined on {format_rank_list(missing)}")
        return results

    def reload(self, module: types.ModuleType) -> types.ModuleType:
        """Reload an edited module here and on every rank that imported it (importlib.reload
        on each); functions from it that later cells send run the new code. Returns the
        reloaded module, as importlib.reload does."""
        if not isinstance(module, types.ModuleType):
            raise TypeError(f"lab.reload needs a module (import it first), got {module!r}")
        self._check_open()
        module = importlib.reload(module)
        self._send_paths()
        ranks = list(range(self.world_size))
        self._send(ranks, modules.reload_here, module.__name__).get(PATHS_TIMEOUT_S)
        return module

    def _send_paths(self, fn=None) -> None:
        """The notebook's sys.path (and fn's module folder) to every rank, when changed."""
        paths = tuple(modules.notebook_paths(fn))
        if paths == self._paths_sent:
            return
        self._check_open()
        ranks = list(range(self.world_size))
        absent = self._send(ranks, modules.add_paths, list(paths)).get(PATHS_TIMEOUT_S)
        self._paths_absent = dict(zip(ranks, absent, strict=True))
        self._paths_sent = paths

    def _explain_missing_module(self, error: RankError) -> None:
        hosts = dict(enumerate(self.processes.hosts))
        for tb in dict.fromkeys(error.tracebacks.values()):
            note = modules.explain_missing(tb, hosts, self._paths_absent)
            if note:
                error.args = (f"{error.args[0]}\n{note}",)
                return

    def _send(self, ranks: list[int], remote_fn, *args):
        """A request to some ranks, outside a cell's watch (the watchdog uses it)."""
        ids = self.processes.engine_ids
        view = self.processes.client.direct_view([ids[r] for r in ranks])
        return view.apply_async(remote_fn, *args, next(self._cells))

    def _dispatch(self, remote_fn, payload, timeout, targets: list[int],
                  cell_timeout: float | None = None, fn=None) -> list:
        self._check_open()
        if self._broken:
            print(f"[tplab] {self._broken}: restarting the ranks first (names defined on them "
                  "are gone)", file=sys.stderr, flush=True)
            self._restart_ranks()
        self._send_paths(fn)  # before the call: unpickling fn may import its module
        cell = next(self._cells)
        client, ids = self.processes.client, self.processes.engine_ids
        if len(targets) < self.world_size:
            view = client.direct_view([ids[r] for r in targets])
        else:
            if self._view is None:  # made once per set of rank processes
                self._view = client.direct_view(ids)
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
