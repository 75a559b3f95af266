"""pytest support for checking your own tensor-parallel code, in the spirit of torch's
`DTensorTestBase` (torch/testing/_internal/distributed/_tensor/common_dtensor.py), but
with one lab for the whole session instead of new processes for every test.

In your conftest.py:

    pytest_plugins = ["tplab.testing"]

then in a test:

    def test_my_plan(tplab_lab):
        report = tplab.grad_check(tplab_lab, build, plan, make_input)
        assert report.ok, str(report)

Options: `--tplab-world-size N` (default 2, or $TPLAB_WORLD_SIZE) and `--tplab-simulated`
(or TPLAB_SIMULATED=1): simulated ranks in the test process, no processes to start.
`assert_grad_check(lab, ...)` is the assert above, with the report as its message.
"""

from __future__ import annotations

import os

import pytest

import tplab
from tplab.lab.contract import Ranks


def pytest_addoption(parser):
    group = parser.getgroup("tplab")
    group.addoption("--tplab-world-size", type=int, default=None,
                    help="ranks of the session's lab (default 2, or $TPLAB_WORLD_SIZE)")
    group.addoption("--tplab-simulated", action="store_true", default=False,
                    help="simulated ranks in this process (tplab.simulate)")


@pytest.fixture(scope="session")
def tplab_lab(request):
    """One lab for the whole test session (processes, or simulated), shut down at its end."""
    world = (request.config.getoption("--tplab-world-size", None)
             or int(os.environ.get("TPLAB_WORLD_SIZE", "2")))
    simulated = (request.config.getoption("--tplab-simulated", False)
                 or os.environ.get("TPLAB_SIMULATED", "") not in ("", "0"))
    lab = tplab.simulate(world) if simulated else tplab.launch(world)
    yield lab
    lab.shutdown()


def assert_grad_check(lab: Ranks, build_model, plan, make_input, **kwargs):
    """`tplab.grad_check(...)`, asserting it passes; the report is the failure message."""
    report = tplab.grad_check(lab, build_model, plan, make_input, **kwargs)
    assert report.ok, str(report)
    return report
