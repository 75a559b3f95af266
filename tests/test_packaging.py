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
    # torch, and the test runner's workers (make test's options are pytest-xdist 3.8's), first
    assert pins[:2] == ["torch==2.13.0", "pytest-xdist==3.8.0"]
    # then every other package, each to one release and each once: a new release on PyPI
    # cannot change what a clean clone installs
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert all(p.count("==") == 1 for p in pins) and len(set(names)) == len(names)
    assert {"transformers", "accelerate", "ipyparallel", "jupyterlab"} <= set(names)
    assert "-c scripts/constraints.txt" in (ROOT / "scripts/env.sh").read_text()
    assert torch.__version__.split("+")[0] == "2.13.0"  # what the set-up installed here


def test_the_environment_is_what_the_constraints_pin():
    import importlib.metadata

    pins = [ln.strip().split("==") for ln in (ROOT / "scripts/constraints.txt").read_text()
            .splitlines() if ln.strip() and not ln.startswith("#")]
    differ = {}
    for name, version in pins:
        try:  # the first on sys.path: setuptools' vendored copies come later, if at all
            there = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pinned for an extra this environment does not have
        if there.split("+")[0] != version:
            differ[name] = (version, there)
    assert not differ, f"(pinned, installed) differ: {differ}"


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
