"""The notebook's modules on the ranks (tplab/lab/modules.py): a module from a folder the
notebook put on sys.path, and a module edited while the lab runs (`lab.reload`)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

import tplab
from tplab.lab import modules


@pytest.fixture(scope="module")
def lab():
    with tplab.launch(2) as lab:
        yield lab


def test_a_module_on_a_path_the_notebook_added(lab, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "mymodel.py").write_text("import os\ndef where():\n    return os.getpid()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("src")  # relative, as a notebook's ../src: the ranks' cwd differs
    import mymodel

    try:
        pids = lab.run(mymodel.where)
        assert pids == lab.rank_pids
        assert lab.execute("import mymodel\nmymodel.__file__") == [str(src / "mymodel.py")] * 2
    finally:
        sys.modules.pop("mymodel", None)


def test_the_folder_of_a_functions_module_reaches_the_ranks(lab, tmp_path):
    """A module loaded from its file (not through sys.path): its folder is sent."""
    (tmp_path / "byfile.py").write_text("def answer():\n    return 42\n")
    spec = importlib.util.spec_from_file_location("byfile", tmp_path / "byfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["byfile"] = module
    try:
        spec.loader.exec_module(module)
        assert str(tmp_path) not in sys.path
        assert lab.run(module.answer) == [42, 42]
    finally:
        sys.modules.pop("byfile", None)


def test_an_edited_module_reloads_on_the_ranks(lab, tmp_path, monkeypatch):
    (tmp_path / "edited.py").write_text("SCALE = 1\ndef scaled(x):\n    return x * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited

    try:
        assert lab.run(edited.scaled, 3) == [3, 3]
        (tmp_path / "edited.py").write_text("SCALE = 10\ndef scaled(x):\n    return x * SCALE\n")
        assert lab.run(edited.scaled, 3) == [3, 3]  # not reloaded: the ranks' old code
        edited = lab.reload(edited)
        assert edited.SCALE == 10  # here too
        assert lab.run(edited.scaled, 3) == [30, 30]
        assert lab.execute("import edited\nedited.SCALE") == [10, 10]
    finally:
        sys.modules.pop("edited", None)


def test_a_module_missing_on_the_ranks_host_is_explained(tmp_path, monkeypatch):
    """What a rank elsewhere says (No module named 'mymodel') gets the notebook's file, the
    host without the folder, and what to do."""
    (tmp_path / "faraway.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("faraway")  # imported in the notebook
    try:
        tb = "Traceback ...\nModuleNotFoundError: No module named 'faraway'\n"
        note = modules.explain_missing(tb, {0: "node1", 1: "node2"},
                                       {0: [str(tmp_path)], 1: []})
        assert os.path.join(str(tmp_path), "faraway.py") in note
        assert f"its folder {tmp_path} does not exist on node1" in note
        assert "shared file system" in note and "lab.reload(faraway)" in note
        assert modules.explain_missing("NameError: x", {}, {}) == ""
    finally:
        sys.modules.pop("faraway", None)


def test_paths_are_added_only_where_they_exist(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    there, absent = str(tmp_path), str(tmp_path / "nope")
    assert modules.add_paths([there, absent, sys.path[-1]]) == [absent]
    assert sys.path[0] == there and absent not in sys.path
