"""Shared fixtures. Jupyter/IPython state goes to a temporary directory, never to $HOME."""

from __future__ import annotations

import os
import tempfile

_STATE = tempfile.mkdtemp(prefix="tplab-test-state-")
for _var, _sub in [("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                   ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"), ("JUPYTER_DATA_DIR", "jupyter-data"),
                   ("MPLCONFIGDIR", "matplotlib")]:
    os.environ[_var] = os.path.join(_STATE, _sub)

import pytest  # noqa: E402
import report  # noqa: E402  (tests/report.py)

import tplab  # noqa: E402


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(_STATE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    for lines in report.LINES.values():
        for line in lines:
            terminalreporter.write_line(line)


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
