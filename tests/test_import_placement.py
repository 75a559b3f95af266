"""Imports sit at the top of their file (../shared/STYLE.md: "the order of the house can be
read from the heads of its files"): an import inside a function is of an optional dependency
(pyproject.toml's extras), or says why it is deferred with `# deferred: <reason>`."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import tplab

ROOT = pathlib.Path(tplab.__file__).parent

# what an import inside a function says when it is there on purpose
DEFERRED = "# deferred:"


def optional_packages() -> set[str]:
    """Import names of the optional dependencies: pyproject.toml's extras that are not in
    its `dependencies` (transformers, accelerate, mpi4py, playwright, hypothesis, ...)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("-", "_")
                for r in requirements}

    extras = set().union(*map(names, project["optional-dependencies"].values()))
    return extras - names(project["dependencies"])


def _statement_groups(tree: ast.AST):
    """(the imports of one run of consecutive import statements, inside a function)."""
    def walk(node, in_function):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            run: list = []
            for stmt in block:
                if in_function and isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.append(stmt)
                    continue
                if run:
                    yield run
                run = []
                yield from walk(stmt, in_function or isinstance(
                    stmt, (ast.FunctionDef, ast.AsyncFunctionDef)))
            if run:
                yield run

    yield from walk(tree, False)


def misplaced_imports(source: str, optional: set[str]) -> list[int]:
    """Lines of the imports inside functions that are neither of an optional dependency
    nor deferred with a reason: `# deferred: <why>` on the import's own lines or in the
    comment directly above its run of imports (a reason of a few words at least)."""
    lines = source.splitlines()

    def reason(text: str) -> bool:
        return DEFERRED in text and len(text.split(DEFERRED, 1)[1].split()) >= 4

    found = []
    for run in _statement_groups(ast.parse(source)):
        above, i = [], run[0].lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip())
            i -= 1
        comment_above = " ".join(above)
        for node in run:
            if isinstance(node, ast.ImportFrom):
                packages = {"tplab" if node.level else (node.module or "").split(".")[0]}
            else:
                packages = {a.name.split(".")[0] for a in node.names}
            own = " ".join(lines[node.lineno - 1:node.end_lineno])
            if packages <= optional or reason(own) or reason(comment_above):
                continue
            found.append(node.lineno)
    return found


def test_imports_sit_at_the_top_of_their_file():
    optional = optional_packages()
    assert {"transformers", "mpi4py"} <= optional and "torch" not in optional
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT.parent).as_posix()
        source = path.read_text()
        bad += [f"{name}:{line}: {source.splitlines()[line - 1].strip()}"
                for line in misplaced_imports(source, optional)]
    assert not bad, ("imports inside functions: move them to the top of the file, or say "
                     f"why not with '{DEFERRED} <reason>':\n" + "\n".join(bad))


def test_the_import_rule_finds_a_function_level_import():
    source = '''
import os


def plain():
    import json
    return json


def optional():
    from transformers import AutoModel
    return AutoModel


def deferred():
    # deferred: the rank loads this after its engine starts (benchmarks/launch.py)
    import torch
    import numpy
    return torch, numpy


def too_short():
    import torch  # deferred: cycle
    return torch


class Shape:
    def method(self):
        def inner():
            from tplab import models
            return models
        if True:
            from . import mesh  # deferred: the rank side must not load it here
        return inner, mesh
'''
    # json (a dependency), a reason of one word, a tplab module in a nested function
    assert misplaced_imports(source, {"transformers"}) == [6, 23, 30]
