"""The rank side of a lab: what runs inside each rank process (an ipyparallel engine).

The notebook sends these functions by reference (this module is installed on every
rank). `init_rank` joins the process group; `call` and `execute` run the user's code
for one cell and hand back either its result, packed for the trip (see transfer.py),
or a `RankFailure` with the full traceback. A small reporter thread writes where the
rank is (which cell, which collective, which line of user code) to the rendezvous
store, so the notebook can say what hangs without asking the busy rank.
"""

from __future__ import annotations

import ast
import faulthandler
import io
import json
import linecache
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass

from tplab.lab.transfer import pack, to_wire

WHERE_KEY = "tplab/where/{rank}"
REPORT_INTERVAL_S = 0.1
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

# Functions (innermost first) whose frame on the stack means "waiting in a collective".
# torch.distributed's own collectives, then DTensor's redistribution steps, whose
# functional collectives end in wait_tensor.
COLLECTIVE_FRAMES = {
    "all_reduce": "all_reduce", "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "send": "send", "recv": "recv", "barrier": "barrier",
    "gather": "gather", "scatter": "scatter", "reduce": "reduce",
    "_reduce_value": "all_reduce", "_reduce_shard_value": "reduce_scatter",
    "_to_replicate_tensor": "all_gather", "_to_new_shard_dim": "all_to_all",
    "wait_tensor": "wait_tensor",
}
_LIBRARY_PARTS = ("<frozen", "threading.py")  # and the packages' own folders, below


def _package_dirs() -> tuple[str, ...]:
    """Folders of code that is not the learner's: a hang is reported at the learner's line."""
    import importlib.util

    dirs = []
    for name in ("torch", "tplab", "ipyparallel", "IPython", "ipykernel", "zmq", "tornado"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
    return tuple(dirs)


_LIBRARY_PARTS += _package_dirs()


@dataclass
class RankFailure:
    """An exception raised by user code on a rank, sent back instead of raised."""

    ename: str
    evalue: str
    traceback: str


class _RankState:
    def __init__(self):
        self.rank = -1
        self.world_size = 0
        self.cell: int | None = None  # the cell running now
        self.cell_started = 0.0
        self.seq_at_start = 0
        self.last_cell: int | None = None
        self.last_cell_collectives = 0
        self.main_thread = threading.main_thread().ident
        self.store = None
        self.reporting = True  # benchmarks/watchdog_overhead.py turns it off to compare


STATE = _RankState()


def _user_ns() -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    return shell.user_ns if shell is not None else sys.modules["__main__"].__dict__


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


def init_rank(rank: int, world_size: int, backend: str, master_addr: str, master_port: int,
              threads: int, local_rank: int | None, timeout_s: float = 120.0) -> int:
    """Join the process group as `rank` and fill the rank's namespace. Returns the pid.

    local_rank (the GPU index on this machine) is given for local engines; engines that
    another launcher started read it from their launcher's environment.
    """
    if local_rank is None:
        local_rank = int(next((os.environ[v] for v in _LOCAL_RANK_VARS if v in os.environ), 0))
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      OMP_NUM_THREADS=str(threads))
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor  # noqa: F401  (warmed up in the background at start)

    import tplab

    torch.set_num_threads(threads)
    from datetime import timedelta

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
                          master_listen_fd=listen_fd)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            **kwargs)
    STATE.rank, STATE.world_size, STATE.store = rank, world_size, store
    if _log_file() is not None:  # a crash in C code prints the Python stack to the log
        faulthandler.enable(file=_log_file(), all_threads=False)
    _user_ns().update(rank=rank, world_size=world_size, torch=torch, dist=dist, tplab=tplab)
    threading.Thread(target=_report_loop, daemon=True, name="tplab-reporter").start()
    return os.getpid()


def _collective_seq() -> int:
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    except Exception:
        return 0


@contextmanager
def _cell(cell: int):
    STATE.seq_at_start = _collective_seq()
    STATE.cell_started = time.monotonic()
    STATE.cell = cell
    try:
        yield
    finally:
        STATE.last_cell_collectives = _collective_seq() - STATE.seq_at_start
        STATE.last_cell = cell
        STATE.cell = None


def _failure(exc: BaseException) -> RankFailure:
    tb = exc.__traceback__
    # Drop the frames of this module: the learner's code starts below them.
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return RankFailure(type(exc).__name__, str(exc), text)


def _expose_namespace(fn) -> None:
    """Let a function sent from the notebook see the rank's names (rank, world_size,
    pushed values) as globals, as code in a %%ranks cell does."""
    g = getattr(fn, "__globals__", None)
    if g is not None and g is not _user_ns():
        for name, value in _user_ns().items():
            g.setdefault(name, value)


class Missing:
    """What `pull` returns for a name the rank does not have."""


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


@dataclass
class Reply:
    """What a rank sends back for a cell: the packed value (or a RankFailure, or
    Missing) and what the cell printed, captured here so that it arrives with the value."""

    value: object
    stdout: str
    stderr: str


class _Capture(io.StringIO):
    """A cell's stdout or stderr: kept to send back with the reply, and copied to the
    process's own output (the rank's log), so that what a rank printed before it died
    can be shown in the RankDied message."""

    def __init__(self, log):
        super().__init__()
        self._log = log

    def write(self, text: str) -> int:
        if self._log is not None:
            try:
                self._log.write(text)
                self._log.flush()
            except (OSError, ValueError):
                self._log = None
        return super().write(text)


_log = None


def _log_file():
    """The rank process's own output file (its log), or None where there is none."""
    global _log
    if _log is None:
        from tplab.lab.entry import LOG_FD_ENV

        fd = os.environ.get(LOG_FD_ENV)
        _log = os.fdopen(int(fd), "w", buffering=1, closefd=False) if fd else False
    return _log or None


def _run_cell(cell: int, body) -> tuple:
    out, err = _Capture(_log_file()), _Capture(_log_file())
    with _cell(cell), redirect_stdout(out), redirect_stderr(err):
        try:
            value = pack(body(), STATE.rank)
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the notebook
            value = _failure(exc)
    return to_wire(Reply(value, out.getvalue(), err.getvalue()))


def call_pickled(payload: bytes, cell: int) -> tuple:
    """Run fn(*args, **kwargs) for `lab.run`; payload is cloudpickle of
    (fn, args, kwargs, fn's source)."""
    import cloudpickle

    def body():
        fn, args, kwargs, source = cloudpickle.loads(payload)
        _restore_source(fn, source)
        _expose_namespace(fn)
        return fn(*args, **kwargs)

    return _run_cell(cell, body)


def execute(code: str, cell: int) -> tuple:
    """Run a cell's code in the rank's namespace; the value is the last expression's."""
    filename = f"<ranks cell {cell}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)

    def body():
        ns = _user_ns()
        tree = ast.parse(code, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), ns)
        if last is not None:
            return eval(compile(ast.Expression(last.value), filename, "eval"), ns)
        return None

    return _run_cell(cell, body)


def push_pickled(payload: bytes, cell: int) -> tuple:
    import cloudpickle

    return _run_cell(cell, lambda: _user_ns().update(cloudpickle.loads(payload)))


def pull(name: str, cell: int) -> tuple:
    ns = _user_ns()
    return _run_cell(cell, lambda: ns[name] if name in ns else Missing())


# --- where is this rank? -------------------------------------------------------------


def _shape_of(frame) -> list[int] | None:
    for name in ("tensor", "input", "input_tensor", "output_tensor", "self", "local_tensor"):
        value = frame.f_locals.get(name)
        shape = getattr(value, "shape", None)
        if shape is not None:
            try:
                return [int(s) for s in shape]
            except TypeError:
                continue
    return None


def where_now() -> dict:
    """Snapshot of the main thread: running which cell, in which collective, at which line."""
    state = STATE
    snap: dict = {"rank": state.rank, "time": time.time()}
    if state.cell is None:
        snap.update(state="finished", cell=state.last_cell,
                    collectives=state.last_cell_collectives)
        return snap
    snap.update(state="running", cell=state.cell,
                seconds=round(time.monotonic() - state.cell_started, 2),
                collectives=_collective_seq() - state.seq_at_start)
    frame = sys._current_frames().get(state.main_thread)
    op = shape = line = None
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if op is None and code.co_name in COLLECTIVE_FRAMES and "torch" in filename:
            op, shape = COLLECTIVE_FRAMES[code.co_name], _shape_of(frame)
        if line is None and not any(part in filename for part in _LIBRARY_PARTS):
            text = linecache.getline(filename, frame.f_lineno).strip()
            line = f"{filename}:{frame.f_lineno} {text}".strip()
        frame = frame.f_back
    if op is not None:
        # c10d numbers a collective when it is issued, so the one waited in is the last.
        snap.update(state="in_collective", op=op, shape=shape, seq=snap["collectives"])
    snap["line"] = line
    return snap


def _report_loop() -> None:
    key = WHERE_KEY.format(rank=STATE.rank)
    last = None
    while True:
        time.sleep(REPORT_INTERVAL_S)
        if not STATE.reporting:
            continue
        running_long = (STATE.cell is not None
                        and time.monotonic() - STATE.cell_started > REPORT_INTERVAL_S)
        marker = ("finished", STATE.last_cell) if STATE.cell is None else None
        if not running_long and marker == last:
            continue
        try:
            STATE.store.set(key, json.dumps(where_now()))
        except Exception:  # the store went away: the lab is shutting down
            return
        last = marker
