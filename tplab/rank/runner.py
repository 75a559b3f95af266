"""The rank side of a lab: what runs inside each rank process (an ipyparallel engine).

The notebook sends these functions by reference (this module is installed on every
rank). `init_rank` joins the process group; `call_pickled` and `execute` run the user's
code for one cell and hand back a `Reply`: the result, packed for the trip (see
tplab/core/transfer.py), or a `RankFailure` with the full traceback. What the cell prints goes
to the rank's output files (fds 1 and 2, see entry.py), which the notebook reads live.

Names resolve on the rank first: a function sent from the notebook runs with the rank's
namespace as its globals. Names the rank defined (rank, world_size, pushed values, names
from %%ranks cells, `global` assignments) win over the notebook's; only names the rank
lacks come from the notebook, and those are refreshed on every call.
"""

from __future__ import annotations

import ast
import faulthandler
import io
import linecache
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (warmed up in the background at start)

import tplab
from tplab import platforms
from tplab.core.output import strip_ansi
from tplab.core.transfer import to_wire, unsendable_part
from tplab.rank import collectives, output_relay, torch_log, whereabouts
from tplab.rank.collectives import REPORT
from tplab.rank.entry import STATE_DIR_ENV, output_paths

NAMESPACE_PID = "tplab:rank-namespace"  # the persistent id of the rank's globals (names.py)
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}
_HERE = (__file__, collectives.__file__)


@dataclass
class RankFailure:
    """An exception raised by user code on a rank, sent back instead of raised."""

    ename: str
    evalue: str
    traceback: str


@dataclass
class Reply:
    """What a rank sends back for a cell: the packed value (or a RankFailure, or Missing),
    the rank's own names when they changed, and notebook names this rank shadowed."""

    value: object
    names: list[str] | None = None
    shadowed: dict[str, str] = field(default_factory=dict)
    # Ranks elsewhere: (offset, bytes) of what fds 1 and 2 got during the cell, so that the
    # notebook has it all even when the forwarder (output_relay.py) is a little behind.
    output: tuple | None = None


class Missing:
    """What `pull` returns for a name the rank does not have."""


class _Names:
    def __init__(self):
        self.from_notebook: dict[str, object] = {}  # name -> the value the notebook sent
        self.last_sent: list[str] | None = None
        self.forward_output = False


NAMES = _Names()


_FORWARDER: list = []  # this rank's output forwarder process, once started
_NAMESPACE: list[dict] = []  # the engine's namespace, looked up once (IPython's is slow)


def _user_ns() -> dict:
    if not _NAMESPACE:
        # deferred: the rank side loads no IPython (tests/test_imports.py); a rank's engine
        # has loaded it already, a plain process has no shell to ask
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            return sys.modules["__main__"].__dict__
        _NAMESPACE.append(shell.user_ns)
    return _NAMESPACE[0]


def _wait_for_port(host: str, port: int, timeout: float) -> None:
    """Poll until rank 0's store listens: a TCPStore client that connects too early
    backs off for 0.3-0.7 s (docs/DESIGN.md)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.01)


def _no_breakpoint(*args, **kwargs) -> None:
    print("breakpoint() cannot stop a rank: a rank process has no terminal to debug in. "
          "Print the values you need, or run the code in tplab.simulate(...), where "
          "breakpoint() works in the notebook.", file=sys.stderr)


def compile_threads(threads: int) -> None:
    """torch.compile's inductor builds its kernels in a pool of min(32, cores) worker
    processes, in every process that compiles: a lab's ranks on one machine would each start
    one, each importing torch, on the same cores. A rank takes its share (`threads`, as torch's
    own pool does) unless TORCHINDUCTOR_COMPILE_THREADS says otherwise; 1 compiles in the
    rank itself."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    if "torch._inductor.config" in sys.modules:  # read at its import: set it there too
        sys.modules["torch._inductor.config"].compile_threads = threads


def init_rank(rank: int, world_size: int, backend: str, master_addr: str, master_port: int,
              threads: int, local_rank: int | tuple[str, ...], timeout_s: float = 120.0,
              output_to: dict | None = None) -> dict:
    """Join the process group as `rank` and fill the rank's namespace. Returns the pid,
    host and output files of this rank.

    local_rank (the GPU index on this machine) is given for local engines; engines that
    another launcher started get the names of their launcher's variables that hold it
    (the engine kind's `local_rank`: SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK...). output_to
    (host, port, key, generation), for ranks whose files the notebook cannot read: where
    this rank's forwarder (output_relay.py) sends its output.
    """
    if not isinstance(local_rank, int):
        local_rank = int(next((os.environ[v] for v in local_rank if v in os.environ), 0))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      OMP_NUM_THREADS=str(threads))
    # torch is loaded (entry.py warmed it); OMP_NUM_THREADS is for processes the rank starts
    torch.set_num_threads(threads)
    compile_threads(threads)
    if rank != 0:
        _wait_for_port(master_addr, master_port, timeout_s)
    listen_fd = None
    if rank == 0:
        # Bind the store to master_addr ourselves: TCPStore alone listens on every
        # interface ("::"), and the lab listens on loopback unless told otherwise.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((master_addr, master_port))
        listener.listen(128)
        listen_fd = listener.detach()
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=listen_fd, **platforms.store_options())
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            **kwargs)
    collectives.note_collectives()
    REPORT.rank, REPORT.store = rank, store
    REPORT.library_parts = ("<frozen", "threading.py", *whereabouts.package_dirs())
    NAMES.forward_output = output_to is not None
    faulthandler.enable(file=sys.__stderr__, all_threads=False)  # fd 2: the rank's err file
    sys.breakpointhook = _no_breakpoint
    _user_ns().update(rank=rank, world_size=world_size, torch=torch, dist=dist, tplab=tplab)
    threading.Thread(target=whereabouts.report_loop, daemon=True, name="tplab-reporter").start()
    whereabouts.report_now()  # a first report: every group's count, for idle ranks
    state_dir = os.environ.get(STATE_DIR_ENV) or "/tmp"
    paths = output_paths(state_dir, os.getpid())
    # torch's log of a failed sharding propagation: the rank's own file, not the notebook
    torch_log.route_to_file(paths[1][:-len(".err")] + ".torch.log")
    if output_to is not None and not _FORWARDER:
        _FORWARDER.append(output_relay.start(rank, output_to["generation"], output_to["host"],
                                             output_to["port"], output_to["key"], *paths))
    return {"pid": os.getpid(), "host": socket.gethostname(), "output": paths}


# --- a cell ------------------------------------------------------------------------------


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:  # noqa: BLE001 - an exception whose __str__ raises
        return f"<{type(exc).__name__}.__str__ raised {type(inner).__name__}: {inner}>"


def _failure(exc: BaseException) -> RankFailure:
    if isinstance(exc, SyntaxError):  # the learner's code, not the parser's frames
        text = "".join(traceback.format_exception_only(type(exc), exc))
    else:
        tb = exc.__traceback__
        # Drop the frames of tplab's rank side: the learner's code starts below them.
        while tb is not None and tb.tb_frame.f_code.co_filename in _HERE:
            tb = tb.tb_next
        try:
            text = "".join(traceback.format_exception(type(exc), exc, tb))
        except Exception:  # noqa: BLE001
            text = "".join(traceback.format_tb(tb)) + f"{type(exc).__name__}: {_safe_str(exc)}\n"
    return RankFailure(type(exc).__name__, _safe_str(exc), strip_ansi(text))


def _rank_names(ns: dict) -> list[str]:
    return sorted(k for k in ns if not k.startswith("_") and k not in NAMES.from_notebook
                  and k not in _IPYTHON_NAMES)


def _offsets() -> tuple[int, int]:
    return (os.fstat(1).st_size, os.fstat(2).st_size) if NAMES.forward_output else (0, 0)


def _read_from(fd: int, offset: int) -> tuple[int, bytes]:
    size = os.fstat(fd).st_size
    return offset, (os.pread(fd, size - offset, offset) if size > offset else b"")


def _run_cell(cell: int, body) -> tuple:
    ns = _user_ns()
    offsets = _offsets()
    reply = Reply(None)
    issued = whereabouts.begin_cell(cell)
    try:
        reply.value = body(reply)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the notebook
        reply.value = _failure(exc)
    finally:
        # The notebook reads finished ranks' collective counts from their last report:
        # end_cell writes one (when the cell changed them, or the reporter wrote a
        # "running" one) before the reply can leave.
        whereabouts.end_cell(cell, issued)
        sys.stdout.flush()
        sys.stderr.flush()
    # A notebook name the cell assigned on the rank (`global x`, x = ... in %%ranks) is
    # the rank's own from now on.
    for name, sent in list(NAMES.from_notebook.items()):
        if ns.get(name, Missing) is not sent:
            del NAMES.from_notebook[name]
    names = _rank_names(ns)
    if names != NAMES.last_sent:
        reply.names = NAMES.last_sent = names
    if NAMES.forward_output:
        reply.output = (_read_from(1, offsets[0]), _read_from(2, offsets[1]))
    try:
        return to_wire(reply, REPORT.rank)
    except Exception:  # noqa: BLE001 - the result cannot travel: say where and why
        path, kind, error = unsendable_part(reply.value, REPORT.rank)
        reply.value = RankFailure(
            "UnsendableResult", error,
            f"the cell's result cannot be sent to the notebook: {path} is a {kind} "
            f"({error}). Return plain data (tensors, numbers, lists, dicts) instead.\n")
        return to_wire(reply, REPORT.rank)


class _RankUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid == NAMESPACE_PID:
            return _user_ns()
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def _load_with_rank_names(payload: bytes, reply: Reply):
    """Unpickle a function sent from the notebook into the rank's namespace: names it
    brings that the rank already defines keep the rank's value (and are reported)."""
    ns = _user_ns()
    before = dict(ns)
    loaded = _RankUnpickler(io.BytesIO(payload)).load()
    for name, value in list(ns.items()):
        old = before.get(name, Missing)
        if old is value:
            continue
        if old is Missing or name in NAMES.from_notebook:
            NAMES.from_notebook[name] = value  # the notebook's (newer) value
            continue
        ns[name] = old  # a name of the rank's own wins
        if not name.startswith("__"):
            reply.shadowed[name] = _short(value)
    return loaded


def _short(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _refile(code, filename: str):
    consts = tuple(_refile(c, filename) if hasattr(c, "co_code") else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _restore_source(fn, source) -> None:
    """Give a function sent by value its file name and source back, for tracebacks."""
    code = getattr(fn, "__code__", None)
    if source is None or code is None or code.co_filename != "<dynamic-code>":
        return
    filename, lines = source
    fn.__code__ = _refile(code, filename)
    if lines:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def call_pickled(payload: bytes, cell: int) -> tuple:
    """Run fn(*args, **kwargs) for `lab.run`; payload is a pickle (tplab/lab/names.py) of
    (fn, args, kwargs, fn's source, the notebook's scalar values of names it left out)."""

    def body(reply: Reply):
        fn, args, kwargs, source, scalars = _load_with_rank_names(payload, reply)
        ns = _user_ns()
        for name, value in scalars.items():
            mine = ns.get(name, Missing)
            if mine is not Missing and type(mine) is type(value) and mine != value:
                reply.shadowed[name] = _short(value)
        _restore_source(fn, source)
        g = getattr(fn, "__globals__", None)
        if g is not None and g is not ns:  # a module's function sent by value
            for name, value in ns.items():  # it sees the rank's names it lacks
                g.setdefault(name, value)
        return fn(*args, **kwargs)

    return _run_cell(cell, body)


def execute(code: str, cell: int) -> tuple:
    """Run a cell's code in the rank's namespace; the value is the last expression's.
    IPython syntax (`!cmd`, `%time ...`) is turned into Python by the rank's own shell."""
    filename = f"<ranks cell {cell}>"

    def body(reply: Reply):
        # deferred: as in _user_ns (the engine has loaded IPython)
        from IPython import get_ipython

        shell = get_ipython()
        source = shell.transform_cell(code) if shell is not None else code
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ns = _user_ns()
        tree = ast.parse(source, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), ns)
        if last is not None:
            return eval(compile(ast.Expression(last.value), filename, "eval"), ns)
        return None

    return _run_cell(cell, body)


def push_pickled(payload: bytes, cell: int) -> tuple:
    def body(reply: Reply):
        values = cloudpickle.loads(payload)
        for name in values:
            NAMES.from_notebook.pop(name, None)  # pushed: the rank's own now
        _user_ns().update(values)

    return _run_cell(cell, body)


def pull(name: str, cell: int) -> tuple:
    ns = _user_ns()
    return _run_cell(cell, lambda reply: ns[name] if name in ns else Missing())


def complete_pending(calls: list[dict], cell: int) -> tuple:
    """Free peers that wait in collectives this rank never called (see collectives.py)."""
    return _run_cell(cell, lambda reply: collectives.complete_pending(calls))
