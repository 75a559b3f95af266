"""Every notebook in notebooks/ runs top to bottom with papermill, in each mode it supports,
at every world size it claims (tplab.lessons.SIZES).

A notebook's claims are asserted in its own cells, so a run that ends without error has
checked the lesson, not only that the cells ran. The default run has world 2 in processes,
the laptop case, for every notebook (06 and 14 at 4 instead: FOUR_NOT_TWO says why; 00's
and 12's are the browser test's Run All when Chromium and playwright are here);
simulated mode at world 2 runs in the browser test (01 and 08 in the default run, every
notebook in the extended run); every other claimed size and mode is `extended` (make
test-extended), which keeps the default run within its 12 minutes on 2 cores. 13 (FSDP2 x
TP) claims world 4 only, in processes: the default run has it at 4 (papermill here, or, as
00 and 12, the browser test's Run All where that can run: once, not twice).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time

import browser
import papermill
import pytest
import report

from tplab.lessons import SIZES

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
_times: dict[str, float] = {}


def modes(path: pathlib.Path) -> list[str]:
    """The modes a notebook supports: its parameters cell says `mode = ...` and, when it
    also runs simulated, has a comment `# modes: processes, simulated`."""
    cells = json.loads(path.read_text())["cells"]
    params = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "".join(params["source"])
    for line in source.splitlines():
        if line.strip().startswith("# modes:"):
            return [m.strip() for m in line.split(":", 1)[1].split(",")]
    return ["processes"]


DEFAULT_SIZE = 2  # the laptop case: every notebook in processes in the default run
# Notebook 12 at world 2 in processes is run by the browser test where it can run: Run All in
# JupyterLab, every cell's asserts included (tests/test_browser.py fails on an error output).
# Run here as well, it would train the same five runs twice in the default run. 00 and 13
# (FSDP2 x TP, world 4) likewise: the browser test's Run All is the same run (ranks in
# processes, every cell's asserts), and 13's was the suite's most expensive test, twice
# (about 100 s each in a fresh clone's run); its papermill run is extended where the
# browser runs it, and default where it cannot.
IN_THE_BROWSER = (("00", "12", "13") if os.path.exists(browser.CHROMIUM)
                  and importlib.util.find_spec("playwright") else ())


def sizes(path: pathlib.Path) -> tuple[int, ...]:
    return SIZES[path.stem[:2]]


def in_default_run(path: pathlib.Path, mode: str, world_size: int) -> bool:
    """World 2 in processes for every notebook; simulated mode at world 2 is the browser
    test's run (tests/test_browser.py: 01 and 08 by default); FOUR_NOT_TWO run at 4 instead
    of 2, and 13's (dp=2) x (tp=2) needs 4 ranks (13 claims 4 alone). The other
    sizes and modes are extended (`make test-extended`), to keep the default run under 15
    minutes on 2 cores."""
    if path.stem.startswith(FOUR_NOT_TWO):
        return mode == "processes" and world_size == 4
    if mode == "processes" and world_size == DEFAULT_SIZE:
        return not path.stem.startswith(IN_THE_BROWSER)
    if path.stem.startswith(AT_FOUR_ONLY):
        return mode == "processes" and not path.stem.startswith(IN_THE_BROWSER)
    return False


# FSDP2 x TP needs a (dp=2, tp=2) mesh: 13 runs at world 4 only
AT_FOUR_ONLY = ("13",)
# 14 claims 2 and 4, but at world 2 its FSDP2 + TP section starts a second lab of 4 ranks
# (each importing Megatron-core and torchtitan): the default run takes it at 4, where one lab
# serves every section (measured: 45 cpu-s at 4 against 59 at 2); its run at 2 is extended
# 06 at world 2 is its 2-D mesh's degenerate case (dp = 1: no dp collective to see); the
# default run takes the lesson at 4, where every claim has a dp group of 2, and 2 is extended
FOUR_NOT_TWO = ("06", "14")

CASES = [pytest.param(p, m, n, id=f"{p.stem}-{m}-{n}",
                      marks=() if in_default_run(p, m, n) else pytest.mark.extended)
         for p in NOTEBOOKS for m in modes(p) for n in sizes(p)]


def test_every_notebook_claims_sizes_and_runs_at_2():
    assert {p.stem[:2] for p in NOTEBOOKS} == set(SIZES)
    assert all(DEFAULT_SIZE in sizes(p) for p in NOTEBOOKS if not p.stem.startswith(
        AT_FOUR_ONLY))
    assert all(sizes(p) == (4,) for p in NOTEBOOKS if p.stem.startswith(AT_FOUR_ONLY))


@pytest.mark.parametrize(("path", "mode", "world_size"), CASES)
def test_notebook_runs(path, mode, world_size, tmp_path):
    started = time.perf_counter()
    papermill.execute_notebook(
        str(path), str(tmp_path / path.name), cwd=str(path.parent),
        parameters={"world_size": world_size, "mode": mode}, kernel_name="python3",
        progress_bar=False, execution_timeout=600,
    )
    _times[f"{path.stem} [{mode}, world {world_size}]"] = time.perf_counter() - started


def test_notebooks_are_saved_without_outputs():
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        assert not any(c.get("outputs") for c in cells if c["cell_type"] == "code"), path.name
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in cells), path


def teardown_module(module):
    if _times:
        report.TIMES["notebooks"] = ("notebook times:", dict(_times))
