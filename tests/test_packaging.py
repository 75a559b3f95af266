"""Packaging for rooms: the package keeps a torch that is already installed (a range, not a
pin); this repository's own set-up installs the exact torch its tests run on."""

from __future__ import annotations

import pathlib

import tomllib
import torch

ROOT = pathlib.Path(__file__).parent.parent


def test_torch_is_a_lower_bound_and_the_pin_is_a_constraint():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.replace(" ", "").startswith("torch"))
    assert spec.replace(" ", "") == "torch>=2.10", spec
    pins = [ln.strip() for ln in (ROOT / "scripts/constraints.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    # torch, and the test runner's workers (make test's options are pytest-xdist 3.8's)
    assert pins == ["torch==2.13.0", "pytest-xdist==3.8.0"]
    assert "-c scripts/constraints.txt" in (ROOT / "scripts/env.sh").read_text()
    assert torch.__version__.split("+")[0] == "2.13.0"  # what the set-up installed here


def test_playwright_is_a_dev_dependency():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert any(d.startswith("playwright") for d in extra)


def test_make_test_runs_pytest_xdist_workers_and_the_set_up_installs_it():
    import importlib.metadata

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert any(d.startswith("pytest-xdist") for d in extra)
    assert "--dist loadgroup" in (ROOT / "Makefile").read_text()  # a module's tests together
    assert importlib.metadata.version("pytest-xdist") == "3.8.0"  # the pin, installed here
