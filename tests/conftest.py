"""Shared fixtures. Jupyter/IPython state goes to a temporary directory, never to $HOME."""

from __future__ import annotations

import os
import tempfile

_STATE = tempfile.mkdtemp(prefix="tplab-test-state-")
for _var, _sub in [("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                   ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"), ("JUPYTER_DATA_DIR", "jupyter-data"),
                   ("MPLCONFIGDIR", "matplotlib")]:
    os.environ[_var] = os.path.join(_STATE, _sub)

import signal  # noqa: E402

# The stop button is pressed in tests with _thread.interrupt_main, which does nothing while
# SIGINT is ignored, as it is when the suite runs as a shell's background job (`make test &`).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import report  # noqa: E402  (tests/report.py)
from xdist.scheduler import LoadScopeScheduling  # noqa: E402

import tplab  # noqa: E402


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(_STATE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    for line in report.lines():
        terminalreporter.write_line(line)


# pytest-xdist (`make test` runs `-n 2 --dist loadgroup`): the tests of a module go to one
# worker together, so that its module-scoped labs start once and services it starts (sshd,
# Slurm, JupyterLab) never meet another module's; the tests of SPREAD are independent (each
# notebook starts its own kernel and lab), so they go to whichever worker is free.
SPREAD = ("test_notebooks.py", "test_workbooks.py")


class ByModule(LoadScopeScheduling):
    """xdist's scope scheduling with a module as the scope, and each test of SPREAD its own.
    (xdist 3.8's loadgroup marks a group by rewriting `item._nodeid`, which pytest 9 no
    longer reads: its groups fell apart, and one module's tests ran on both workers.)"""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return nodeid if path.rsplit("/", 1)[-1] in SPREAD else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return ByModule(config, log)
    return None


# Under xdist the longest modules (measured with --durations=0) start first, and the spread
# notebooks last, so that no worker begins a long module while the others end: `make test`
# passes --no-loadscope-reorder, which keeps this order (xdist would order by test count).
FIRST = ("test_engines.py", "test_browser.py", "test_verdicts.py", "test_doctor.py",
         "test_fsdp.py", "test_training.py", "test_room.py", "test_cells.py")


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by fixture)
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker collects; each sends the same order
        def rank(item):
            name = item.path.name
            return (FIRST.index(name) if name in FIRST
                    else len(FIRST) + 1 if name in SPREAD else len(FIRST))
        items.sort(key=rank)  # stable: a module's own order (and its labs' reuse) is kept


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: send the report home
        session.config.workeroutput["tplab_report"] = {"lines": report.LINES,
                                                       "times": report.TIMES}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist's controller, as each worker ends
    sent = getattr(node, "workeroutput", {}).get("tplab_report")
    if sent:
        report.merge(sent["lines"], sent["times"])


class _Labs:
    """Labs shared by every test of the session, one per world size, started on first use."""

    def __init__(self):
        self._labs: dict[int, tplab.Lab] = {}

    def get(self, world_size: int) -> tplab.Lab:
        lab = self._labs.get(world_size)
        if lab is None or lab.closed:
            lab = self._labs[world_size] = tplab.launch(world_size, timeout=60)
        return lab

    def close(self):
        for lab in self._labs.values():
            lab.shutdown()


@pytest.fixture(scope="session")
def labs():
    pool = _Labs()
    yield pool
    pool.close()


@pytest.fixture(scope="session", params=[2, 4], ids=lambda n: f"world{n}")
def lab(request, labs):
    """A running lab of 2, then 4 ranks (shared across the session)."""
    return labs.get(request.param)
