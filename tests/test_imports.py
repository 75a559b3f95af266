"""tplab's modules import each other without cycles: each module's top-level imports (read
with ast, the ones a module runs when it loads) form a graph with no loop, so the order
the modules load in is the order they depend on each other. And the sides: the rank side
(tplab/rank/ and the TP code a rank runs) loads nothing of the notebook side."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

import tplab

ROOT = pathlib.Path(tplab.__file__).parent


def module_files() -> dict[str, pathlib.Path]:
    """{dotted module name: its file} for every module of tplab."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def top_level_imports(name: str, path: pathlib.Path, modules, inside_functions=False) -> set[str]:
    """The tplab modules `name` imports when it loads: its module-level statements (and
    those under a module-level `if` or `try`), not imports inside functions unless
    `inside_functions` (then every import of the file). `from pkg import sub` counts as
    importing the module pkg.sub when there is one, else pkg itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for stmt in ast.parse(path.read_text()).body:
        deep = inside_functions or isinstance(stmt, (ast.If, ast.Try))
        nodes = ast.walk(stmt) if deep else [stmt]
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    out = set()
    for dep in found:
        while dep and dep not in modules:  # tplab.x.name -> tplab.x
            dep = dep.rpartition(".")[0]
        if dep and dep != name:
            out.add(dep)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm):
    each is a set of modules that import each other in a loop."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(inside_functions: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    return {name: top_level_imports(name, path, modules, inside_functions)
            for name, path in modules.items()}


def test_the_cycle_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_tplabs_imports():
    graph = import_graph()
    assert "tplab.mesh" in graph["tplab.megatron"] and "tplab.rng" in graph["tplab.models"]
    assert "tplab.cost.shapes" in graph["tplab.cost.memory"]


# Cycles closed by an import inside a function, known and to be broken (#29): remove each
# once it is (the test below fails on one that no longer exists).
KNOWN_DEFERRED_CYCLES: list[list[str]] = []


@pytest.mark.parametrize("inside_functions", [False, True])
def test_tplab_has_no_import_cycles(inside_functions):
    # also through imports inside functions: a deferred import that closes a loop is a
    # cycle all the same, only one that shows later (doctor <-> smoke did)
    graph = import_graph(inside_functions)
    found = cycles(graph)
    known = KNOWN_DEFERRED_CYCLES if inside_functions else []
    loops = [loop for loop in found if loop not in known]
    assert not loops, "import cycles among tplab's modules: " + "; ".join(
        " <-> ".join(f"{m} (imports {sorted(graph[m] & set(loop))})" for m in loop)
        for loop in loops)
    gone = [loop for loop in known if loop not in found]
    assert not gone, f"no longer cycles: remove them from KNOWN_DEFERRED_CYCLES: {gone}"


def test_the_graph_sees_imports_inside_functions():
    modules = module_files()
    inside = top_level_imports("tplab.doctor", modules["tplab.doctor"], modules, True)
    assert "tplab.smoke" in inside  # its deferred import
    assert "tplab.smoke" not in top_level_imports("tplab.doctor", modules["tplab.doctor"],
                                                  modules)


# --- the sides: tplab/rank/ runs inside the rank processes -------------------------------

# Every module's side. "rank": runs only inside a rank process (tplab/rank/). "notebook": runs
# only in the notebook's kernel (it starts ranks, talks to them, draws, judges). "both": the TP
# library a cell calls on the ranks, that a Simulation runs in the notebook, and the pure data
# and math both sides share. A new module must be given a side here (test_every_module_has_a_side).
RANK, NOTEBOOK, BOTH = "rank", "notebook", "both"
SIDES = {
    # the rank processes' own code, and the rank halves of tplab's checks
    **dict.fromkeys(["tplab.rank", "tplab.rank.runner", "tplab.rank.collectives",
                     "tplab.rank.network", "tplab.rank.entry", "tplab.rank.forward",
                     "tplab.rank.torch_log", "tplab.rank.reports", "tplab.rank.stream",
                     "tplab.rank.grad_step", "tplab.rank.train_step",
                     "tplab.rank.explore_step"], RANK),
    # the TP library and what both sides exchange
    **dict.fromkeys(["tplab", "tplab.errors", "tplab.output", "tplab.transfer",
                     "tplab.placements", "tplab.ops", "tplab.pytrees", "tplab.mesh",
                     "tplab.megatron", "tplab.megatron.operators", "tplab.megatron.layers",
                     "tplab.models", "tplab.rng", "tplab.plans", "tplab.plan_check",
                     "tplab.handovers", "tplab.layout_contracts", "tplab.layout_flow",
                     "tplab.parallel_styles",
                     "tplab.hf", "tplab.tracing", "tplab.causes", "tplab.explain",
                     "tplab.layouts", "tplab.fsdp", "tplab.fsdp_layout", "tplab.checkpointing",
                     "tplab.compiling", "tplab.pairing",
                     "tplab.report",
                     "tplab.memory_use",
                     "tplab.lessons", "tplab.platforms", "tplab.training",
                     "tplab.training.clip", "tplab.training.noise", "tplab.training.band",
                     "tplab.training.lm", "tplab.training.steps", "tplab.exercises",
                     "tplab.exercises.steps", "tplab.exercises.qk_norm_step",
                     "tplab.exercises.clipping", "tplab.exercises.mistakes",
                     "tplab.exercises.solutions", "tplab.cost", "tplab.cost.collectives",
                     "tplab.cost.data_parallel", "tplab.cost.gemm", "tplab.cost.hardware",
                     "tplab.cost.lab_models", "tplab.cost.memory", "tplab.cost.nccl",
                     "tplab.cost.shapes", "tplab.cost.step", "tplab.cost.transformer",
                     "tplab.cost.validate", "tplab.cost.calibrate", "tplab.cost.kernels",
                     "tplab.cost.pipeline", "tplab.cost.training_run",
                     "tplab.cost.published"], BOTH),
    # the notebook's kernel: the launcher, checks that drive a lab, figures, widgets, tools
    **dict.fromkeys(["tplab.__main__", "tplab.check", "tplab.cli_check", "tplab.doctor",
                     "tplab.smoke", "tplab.hf_models", "tplab.testing", "tplab.widgets",
                     "tplab.training.check", "tplab.training.report", "tplab.training.live",
                     "tplab.exercises.catalog", "tplab.exercises.checks", "tplab.fsdp_report",
                     "tplab.exercises.feedback", "tplab.exercises.qk_norm",
                     "tplab.exercises.training_check", "tplab.exercises.fsdp_placements",
                     "tplab.cost.explorer", "tplab.cost.figures"], NOTEBOOK),
}


def side_of(module: str) -> str | None:
    """A module's side: its entry in SIDES, or its package's (tplab.lab.*, tplab.viz.*)."""
    if module in SIDES:
        return SIDES[module]
    if module == "tplab.lab" or module.startswith(("tplab.lab.", "tplab.viz")):
        return NOTEBOOK
    return None


# tplab.rank.stream subclasses the engine kernel's OutStream: test_a_ranks_output_stream_... below
RANK_SIDE = sorted(m for m in module_files()
                   if side_of(m) in (RANK, BOTH) and m != "tplab.rank.stream")
NOTEBOOK_ONLY = ("IPython", "ipykernel", "ipyparallel", "plotly", "ipywidgets",
                 *sorted(m for m in module_files() if side_of(m) == NOTEBOOK))


def test_every_module_has_a_side():
    missing = sorted(m for m in module_files() if side_of(m) is None)
    assert not missing, f"give these modules a side in SIDES (tests/test_imports.py): {missing}"
    stale = sorted(set(SIDES) - set(module_files()))
    assert not stale, f"SIDES names modules that no longer exist: {stale}"


def loaded_after_import(modules: list[str], *, env=None) -> list[str]:
    """The modules a fresh interpreter holds after importing `modules` (a subprocess: this
    test process has imported the notebook side already)."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent, env=env)
    return json.loads(out.stdout.splitlines()[-1])


def notebook_side(loaded: list[str], allowed: tuple = ()) -> list[str]:
    return [m for m in loaded if any(m == p or m.startswith(p + ".") for p in NOTEBOOK_ONLY)
            and not any(m == a or m.startswith(a + ".") for a in allowed)]


def test_the_rank_side_imports_nothing_of_the_notebook_side():
    loaded = loaded_after_import(RANK_SIDE)
    assert "tplab.rank.runner" in loaded and "torch" in loaded
    found = notebook_side(loaded)
    if found:  # which rank-side module pulled it in
        culprits = {m: notebook_side(loaded_after_import([m])) for m in RANK_SIDE}
        found = {m: f for m, f in culprits.items() if f}
    assert not found, f"rank-side modules that load the notebook side: {found}"


def test_a_ranks_output_stream_needs_only_the_engines_kernel():
    # the engine's out_stream_factory subclasses ipykernel's OutStream (IPython comes with
    # it, as in every engine); the ipyparallel client, plotly and widgets stay out
    loaded = loaded_after_import(["tplab.rank.stream"])
    assert "ipykernel.iostream" in loaded
    assert notebook_side(loaded, allowed=("IPython", "ipykernel")) == []


def test_the_side_check_sees_a_notebook_import():
    assert notebook_side(loaded_after_import(["tplab.lab.streams"])) != []


def test_no_rank_module_names_the_notebook_side():
    # function-level imports too: a rank runs those when it calls the function
    for path in (ROOT / "rank").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("tplab.lab", "tplab.viz")), (path, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("tplab.lab") for a in node.names), path


# --- imports at the top of a file (docs/STYLE: "the order of the house can be read from the
# heads of its files") -------------------------------------------------------------------

# The lead splits these by side (#21) and makes them follow the rule as they merge; remove
# each from here then (the test below fails on a name that is no longer a file).
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
