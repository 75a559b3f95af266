"""What a cell is, on a Lab: `run`, `execute`, `push` and `pull`, each one request to the
ranks watched by the Watchdog until every rank answered (docs/DESIGN.md, "Cells"); and
`reload`, an edited module loaded anew on the ranks.

`Cells` is a component of the Lab (launch.py), which keeps the processes' life: it owns
what a cell needs between cells (the DirectView on every rank, the sys.path the ranks
last got), and asks the lab only `ready()` before each request (the lab open, its ranks
started: a restart that did not finish is redone) and the limits each call gets."""

from __future__ import annotations

import importlib
import types

import cloudpickle

from tplab.errors import LabError, RankError, format_rank_list
from tplab.lab import modules
from tplab.lab.arguments import check_ranks
from tplab.lab.cluster import LabProcesses
from tplab.lab.displays import show_rank_displays
from tplab.lab.names import RankNames, payload_for_run
from tplab.lab.results import RankResults
from tplab.lab.watchdog import Watchdog
from tplab.rank import runner as rank_side

PATHS_TIMEOUT_S = 30.0


class Cells:
    """The work half of `tplab.Lab` (see the module docstring)."""

    def __init__(self, world_size: int, processes: LabProcesses, names: RankNames,
                 watchdog: Watchdog, ready):
        self.world_size = world_size
        self.processes = processes  # the ranks: client, engine ids, hosts
        self.names = names  # which names each rank defines itself
        self.watchdog = watchdog  # waits for a cell (live output, hangs, deaths)
        self._ready = ready  # () -> the generation of the running ranks (Lab's)
        self._view = None  # a DirectView on every rank, made once per set of ranks
        self._paths_sent: tuple | None = None  # the notebook's sys.path as the ranks got it
        self._paths_absent: dict = {}  # rank -> folders of that path its host does not have

    def forget_ranks(self) -> None:
        """Fresh ranks: no view on them yet, and they have not got sys.path."""
        self._view = None
        self._paths_sent, self._paths_absent = None, {}

    def run(self, fn, args: tuple, kwargs: dict, timeout: float, ranks,
            cell_timeout: float | None) -> list:
        """fn(*args, **kwargs) on `ranks` (Lab.run says what a cell is)."""
        if not callable(fn):
            raise TypeError(f"lab.run needs a function as its first argument, got {fn!r}")
        targets = check_ranks(ranks, self.world_size)
        payload = payload_for_run(fn, args, kwargs, self.names.known(targets))
        try:
            return self._dispatch(rank_side.call_pickled, payload, timeout, targets,
                                  cell_timeout, fn)
        except RankError as error:
            self._explain_missing_module(error)
            raise

    def execute(self, code: str, timeout: float, ranks, cell_timeout: float | None) -> list:
        """Run code on `ranks` (what %%ranks does); item r is the last expression's value."""
        if not isinstance(code, str):
            raise TypeError(f"lab.execute needs code as a string, got {type(code).__name__}")
        targets = check_ranks(ranks, self.world_size)
        try:
            return self._dispatch(rank_side.execute, code, timeout, targets, cell_timeout)
        except RankError as error:
            self._explain_missing_module(error)
            raise

    def push(self, mapping: dict, ranks, timeout: float, cell_timeout: float | None) -> None:
        """Set names in every rank's namespace (they are the ranks' own names from then on)."""
        if not isinstance(mapping, dict):
            raise TypeError(f"lab.push needs a dict of name -> value, got {type(mapping).__name__}")
        bad = [k for k in mapping if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ValueError(f"lab.push needs names (identifiers) as keys, got {bad[0]!r}")
        targets = check_ranks(ranks, self.world_size)
        payload = self._dumps(mapping, "a value pushed")
        self._dispatch(rank_side.push_pickled, payload, timeout, targets, cell_timeout)

    def pull(self, name: str, ranks, timeout: float, cell_timeout: float | None) -> list:
        """The value of `name` on every rank; a LabError names the ranks that lack it."""
        if not isinstance(name, str):
            raise TypeError(f"lab.pull needs a name (a string), got {type(name).__name__}")
        targets = check_ranks(ranks, self.world_size)
        results = self._dispatch(rank_side.pull, name, timeout, targets, cell_timeout)
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
        self._ready()
        module = importlib.reload(module)
        self._send_paths()
        ranks = list(range(self.world_size))
        self.processes.send(ranks, modules.reload_here, module.__name__).get(PATHS_TIMEOUT_S)
        return module

    def _send_paths(self, fn=None) -> None:
        """The notebook's sys.path (and fn's module folder) to every rank, when changed."""
        paths = tuple(modules.notebook_paths(fn))
        if paths == self._paths_sent:
            return
        ranks = list(range(self.world_size))
        absent = self.processes.send(ranks, modules.add_paths, list(paths)).get(PATHS_TIMEOUT_S)
        self._paths_absent = dict(zip(ranks, absent, strict=True))
        self._paths_sent = paths

    def _explain_missing_module(self, error: RankError) -> None:
        hosts = dict(enumerate(self.processes.hosts))
        for tb in dict.fromkeys(error.tracebacks.values()):
            note = modules.explain_missing(tb, hosts, self._paths_absent)
            if note:
                error.args = (f"{error.args[0]}\n{note}",)
                return

    def _dispatch(self, remote_fn, payload, timeout: float, targets: list[int],
                  cell_timeout: float | None, fn=None) -> list:
        generation = self._ready()
        self._send_paths(fn)  # before the call: unpickling fn may import its module
        cell = self.processes.next_request()
        client, ids = self.processes.client, self.processes.engine_ids
        if len(targets) < self.world_size:
            view = client.direct_view([ids[r] for r in targets])
        else:
            if self._view is None:  # made once per set of rank processes
                self._view = client.direct_view(ids)
            view = self._view
        ar = view.apply_async(remote_fn, payload, cell)  # one request for all ranks
        order = targets if len(targets) < self.world_size else list(range(self.world_size))
        res = RankResults(ar, order)
        try:
            results = self.watchdog.wait(res, cell, timeout, cell_timeout)
        finally:
            if generation == self.processes.generation:  # not after a restart: names gone
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
