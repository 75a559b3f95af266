"""Each notebook says which world sizes it runs at, in its first cells."""

from __future__ import annotations

import json
import pathlib

import pytest

import tplab
from tplab.lessons import SIZES, require_world_size

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_a_size_that_does_not_fit_names_those_that_do():
    assert require_world_size("06", 2) == 2
    with pytest.raises(tplab.LabError, match=r"notebook 06 runs at world_size 2, 4, 6 or 8, "
                                             r"not 3"):
        require_world_size("06", 3)
    with pytest.raises(tplab.LabError, match="not '4'"):
        require_world_size("01", "4")


def test_a_notebook_of_one_size_says_that_size_only():
    with pytest.raises(tplab.LabError) as e:
        require_world_size("13", 2)
    assert str(e.value) == ("notebook 13 runs at world_size 4 only, not 2: set world_size in "
                            "its first cell (the parameters) to 4")
    with pytest.raises(tplab.LabError, match="not True"):
        require_world_size("00", True)


def test_every_notebook_checks_its_world_size_before_starting_ranks():
    assert sorted(SIZES) == [p.name[:2] for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        code = [("".join(c["source"])) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "code"]
        start = next(i for i, s in enumerate(code) if "tplab.launch(" in s
                     or "tplab.simulate(" in s)
        src = code[start]
        call = f'require_world_size("{path.name[:2]}", world_size)'
        assert call in src and src.index(call) < min(
            i for i in (src.find("tplab.launch("), src.find("tplab.simulate(")) if i >= 0), path
        # what the tests run (13, FSDP2 x TP on a (2, 2) mesh, at 4 only)
        assert 4 in SIZES[path.name[:2]] and (2 in SIZES[path.name[:2]] or path.name[:2] == "13")
