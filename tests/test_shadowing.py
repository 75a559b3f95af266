"""Issue 38: a folder named `tplab` in the working directory (a checkout's root) shadowed the
package: `import tplab` gave an empty namespace package, in the notebook and on the ranks
("module 'tplab' has no attribute 'launch'"). Now the mistake is named, on both sides."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import tplab
from tplab.lab.arguments import shadowing_folder

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_checkout_named_tplab_in_the_working_directory_says_so(tmp_path):
    (tmp_path / "tplab").symlink_to(ROOT, target_is_directory=True)   # `git clone ... tplab`
    run = subprocess.run([sys.executable, "-c", "import tplab; tplab.launch"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the folder ") and str(tmp_path / "tplab") in last
    assert "checkout of tplab" in last and "has no attribute" not in run.stderr


@pytest.mark.parametrize("checkout", [True, False], ids=["checkout", "empty-folder"])
def test_launch_refuses_a_working_directory_that_would_shadow_the_ranks(tmp_path, monkeypatch,
                                                                        checkout):
    folder = tmp_path / "tplab"
    if checkout:
        folder.symlink_to(ROOT, target_is_directory=True)
    else:
        folder.mkdir()   # no __init__.py: an empty namespace package on the ranks
    assert shadowing_folder(str(tmp_path)) == str(folder)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tplab.LabError, match=f"the folder {folder} in the working directory "
                                             "shadows the tplab package"):
        tplab.launch(2)


def test_the_package_itself_and_other_folders_do_not_count(tmp_path):
    assert shadowing_folder(str(ROOT)) is None           # the checkout's own tplab/
    assert shadowing_folder(str(tmp_path)) is None        # no tplab folder
    (tmp_path / "tplab.txt").write_text("")
    assert shadowing_folder(str(tmp_path)) is None
    assert os.path.isdir(ROOT / "tplab")
