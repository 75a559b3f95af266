"""The GPU check (scripts/gpu_check.sh, benchmarks/gpu.py) on a machine without a GPU: it
says why it checks nothing and exits 0, so that it can run anywhere (issue 39); the GPU
numbers themselves are docs/VALIDATION.md's "The GPU path on one H200"."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_the_gpu_check_without_a_gpu_says_so_and_exits_0():
    env = {**os.environ, "TPLAB_PYTHON": sys.executable}
    out = subprocess.run([str(REPO / "scripts/gpu_check.sh"), "--all"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SKIP: this torch build has no CUDA" in out.stdout or \
        "SKIP: no CUDA GPU is visible" in out.stdout, out.stdout
    assert "Nothing was checked." in out.stdout
