"""The exercise workbooks (notebooks/exercises/) run by papermill twice: with the reference
solutions injected, every check passes; with the typical mistakes, every check fails with
its message (tplab.exercises.Workbook asserts both, cell by cell).

The default run has every workbook with its solutions, and the first with its mistakes; the
other workbooks' mistakes are `extended`: every typical mistake of every exercise fails
with its message on real ranks in tests/test_exercises.py::test_on_real_ranks, and the
first workbook shows that `inject="mistakes"` reaches each check cell of a workbook.

Real ranks (`mode="processes"`, a workbook's default) run the first workbook with its
solutions, which shows a workbook launching its lab; the other default runs use
`mode="simulated"` (the same cells, all ranks in the kernel: no rank processes to start,
measured 30% less CPU a run), and their `processes` runs are `extended`. Every exercise's
verdict on real ranks, solution and every mistake, is asserted by
tests/test_exercises.py::test_on_real_ranks."""

from __future__ import annotations

import json
import pathlib
import time

import papermill
import pytest
import report

WORKBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks" / "exercises")
                   .glob("*.ipynb"))
_times: dict[str, float] = {}


def _checks(cells) -> int:
    return sum("book.check(" in "".join(c["source"]) for c in cells if c["cell_type"] == "code")


def _verdicts(cells) -> list[str]:
    """data-passed of every Feedback box the run displayed, in order."""
    out = []
    for c in cells:
        for o in c.get("outputs", []):
            html = o.get("data", {}).get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            if 'class="tplab-feedback"' in html:
                out.append(html.split('data-passed="', 1)[1].split('"', 1)[0])
    return out


def test_workbooks_are_saved_without_outputs():
    assert len(WORKBOOKS) >= 2
    names = []
    for path in WORKBOOKS:
        cells = json.loads(path.read_text())["cells"]
        assert not any(c.get("outputs") for c in cells if c["cell_type"] == "code"), path.name
        assert "parameters" in cells[1]["metadata"].get("tags", []), path.name
        names += [s.split('"')[1] for c in cells if c["cell_type"] == "code"
                  for s in ["".join(c["source"])] if s.startswith("book.check(")]
    from tplab import exercises

    assert sorted(names) == sorted(exercises.names())  # every exercise has a workbook cell


def _default(i: int, inject: str, mode: str) -> bool:
    """In the default run: every workbook's solutions and the first one's mistakes, once
    each: the first workbook's solutions on real ranks, the others simulated."""
    if inject == "mistakes" and i > 0:
        return False
    return mode == ("processes" if (i, inject) == (0, "solutions") else "simulated")


CASES = [pytest.param(path, inject, mode, id=f"{path.stem}-{inject}-{mode}",
                      marks=() if _default(i, inject, mode) else pytest.mark.extended)
         for i, path in enumerate(WORKBOOKS) for inject in ("solutions", "mistakes")
         for mode in ("processes", "simulated")]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "inject", "mode"), CASES)
def test_workbook(path, inject, mode, tmp_path):
    started = time.perf_counter()
    out = tmp_path / path.name
    papermill.execute_notebook(str(path), str(out), cwd=str(path.parent),
                               parameters={"world_size": 2, "inject": inject, "mode": mode},
                               kernel_name="python3", progress_bar=False,
                               execution_timeout=300)
    _times[f"{path.stem} [{inject}, {mode}]"] = time.perf_counter() - started
    cells = json.loads(out.read_text())["cells"]
    verdicts = _verdicts(cells)
    assert len(verdicts) == _checks(json.loads(path.read_text())["cells"])
    assert set(verdicts) == {"true" if inject == "solutions" else "false"}


def teardown_module(module):
    if _times:
        report.TIMES["workbooks"] = ("exercise workbooks:", dict(_times))
