"""tplab's modules import each other without cycles, and each module's side follows from
where it lives.

Cycles: the imports of whole files (read with ast, those inside functions too: a deferred
import that closes a loop is a cycle all the same, one that only shows later) form a graph
with no loop, so the order modules load in is the order they depend on each other.

Sides, from the path alone (no table to keep up to date):
- tplab/rank/: the rank side, what runs inside a rank process (or a Simulation's ranks);
- the notebook side: the folders tplab/lab/ (labs), tplab/viz/ (figures), tplab/checks/
  (grad_check, train_check, the CLI and doctor), tplab/cost/ (the cost model),
  tplab/exercises/, and the top-level modules NOTEBOOK_MODULES names: the entry points
  tplab/__main__.py and tplab/testing.py and the public notebook tools tplab/widgets.py,
  tplab/hf_models.py and tplab/fsdp_report.py;
- everything else is both sides: tplab/__init__.py, the library's public modules at the top
  (tplab/plans.py, tplab/megatron/, ...: the TP library a cell calls on the ranks that a
  Simulation runs in the notebook) and tplab/core/, what they are built on.
The rank side and both sides import nothing of the notebook side: no tplab notebook module,
no IPython display, ipyparallel client, plotly or ipywidgets; not at the top of a file, not
inside a function (a rank runs those when it calls the function).
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

import tplab

ROOT = pathlib.Path(tplab.__file__).parent
RANK, NOTEBOOK, BOTH = "rank", "notebook", "both"
NOTEBOOK_PLACES = ("lab", "viz", "checks", "cost", "exercises")  # folders under tplab/
# top-level modules of the notebook side: `python -m tplab`, pytest_plugins = ["tplab.testing"],
# and the public notebook tools (`import tplab.widgets`)
NOTEBOOK_MODULES = ("__main__", "testing", "widgets", "hf_models", "fsdp_report")


def module_files() -> dict[str, pathlib.Path]:
    """{dotted module name: its file} for every module of tplab."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def side_of(module: str) -> str | None:
    """A module's side, from its dotted name (its path); None for one that has no place."""
    parts = module.split(".")
    place = parts[1] if len(parts) > 1 else None
    if place == "rank":
        return RANK
    if place in NOTEBOOK_PLACES or (len(parts) == 2 and place in NOTEBOOK_MODULES):
        return NOTEBOOK
    return BOTH


def imports_of(name: str, path: pathlib.Path, modules) -> dict[str, int]:
    """{module imported: line} for every import in the file (inside functions, classes,
    `if` and `try` too). tplab modules by their dotted name (`from pkg import sub` counts as
    importing pkg.sub when there is one, else pkg itself; `tplab.x.name` as tplab.x); other
    packages by the dotted name written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.setdefault(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for a in node.names:
                full = f"{base}.{a.name}"
                found.setdefault(full if full in modules else base, node.lineno)
    out = {}
    for dep, line in found.items():
        if dep == "tplab" or dep.startswith("tplab."):
            while dep not in modules:  # tplab.x.name -> tplab.x
                dep = dep.rpartition(".")[0]
        if dep != name:
            out.setdefault(dep, line)
    return out


@functools.cache  # read once: the tests below only look at it
def import_graph() -> dict[str, set[str]]:
    """{tplab module: the tplab modules its file imports}."""
    modules = module_files()
    return {name: {d for d in imports_of(name, path, modules) if d in modules}
            for name, path in modules.items()}


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


def test_the_cycle_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_tplabs_imports():
    graph = import_graph()
    assert "tplab.mesh" in graph["tplab.megatron"]
    assert "tplab.core.rng_streams" in graph["tplab.models"]
    assert "tplab.cost.shapes" in graph["tplab.cost.memory"]
    assert "tplab.plan_check.fit" in graph["tplab.plan_check"]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    # a deferred import that closes a loop: the doctor's smoke test once did (#29)
    (tmp_path / "a.py").write_text("import os\n\n\ndef later():\n    from tplab import b\n")
    (tmp_path / "b.py").write_text("from tplab.a import x\n")
    modules = {"tplab.a": tmp_path / "a.py", "tplab.b": tmp_path / "b.py"}
    graph = {m: set(imports_of(m, p, modules)) & set(modules) for m, p in modules.items()}
    assert graph == {"tplab.a": {"tplab.b"}, "tplab.b": {"tplab.a"}}
    assert cycles(graph) == [["tplab.a", "tplab.b"]]
    doctor = module_files()["tplab.checks.doctor"]
    assert "tplab.checks.smoke" in imports_of("tplab.checks.doctor", doctor, module_files())


def test_tplab_has_no_import_cycles():
    graph = import_graph()
    loops = cycles(graph)
    assert not loops, "import cycles among tplab's modules: " + "; ".join(
        " <-> ".join(f"{m} (imports {sorted(graph[m] & set(loop))})" for m in loop)
        for loop in loops)



def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports a -> b -> ... (the graph has no cycles), first found
    in sorted order: how many floors the house has."""
    memo: dict[str, list[str]] = {}

    def down(v):
        if v not in memo:
            below = [down(w) for w in sorted(graph.get(v, ())) if w in graph]
            memo[v] = [v, *max(below, key=len, default=[])]
        return memo[v]

    return max((down(v) for v in sorted(graph)), key=len, default=[])


def test_the_chain_finder_finds_the_longest_chain():
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": {"e"}, "e": {"f"}, "f": set()}
    assert longest_chain(graph) == ["a", "d", "e", "f"]
    assert longest_chain({"a": set()}) == ["a"]


# Measured on 151d749 (issue 36 item 6): 19 files; 14 after rng's streams became a leaf.
# Then (r36) a few leaves many use, with consumers above them: errors names ranks itself
# (format_rank_list; core.output reads it), compile's refusals a leaf (core/compositions.py:
# fsdp no longer imports the compile runner), DP_REDUCTIONS with the losses, explain reads
# megatron's operators, hf its vocab check, clip and lm the mesh and rng streams they use.
# 10 today, e.g. exercises -> catalog -> cost -> training_run -> pipeline -> data_parallel
# -> collectives -> nccl -> hardware -> validate.
TALLEST_CHAIN = 10


def test_the_import_tower_grows_no_taller():
    chain = longest_chain(import_graph())
    assert len(chain) <= TALLEST_CHAIN, (
        f"the longest import chain is {len(chain)} files deep (at most {TALLEST_CHAIN}): "
        + " -> ".join(chain))


# --- arrows that would run back up (issue 36 item 5) --------------------------------------
# core/ is what the library is built on: it imports nothing of the rank side; figures and
# the widgets only display: what judges a run (tplab/checks/) imports them, not the reverse
BARRED = (("tplab.core", "tplab.rank"), ("tplab.viz", "tplab.checks"),
          ("tplab.widgets", "tplab.checks"))


def barred_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The imports `a -> b` of the graph that BARRED forbids."""
    return [f"{m} -> {dep}" for m in sorted(graph) for dep in sorted(graph[m])
            for low, high in BARRED if under(m, (low,)) and under(dep, (high,))]


def test_no_arrow_runs_from_core_to_the_ranks_or_from_a_display_to_the_checks():
    bad = barred_arrows(import_graph())
    assert not bad, "imports that run back up: " + "; ".join(bad)


def test_the_arrow_rule_sees_a_barred_import():
    graph = {"tplab.core.answers.qk_norm": {"tplab.rank.qk_norm_step", "tplab.losses"},
             "tplab.widgets": {"tplab.checks.grad"}, "tplab.viz.check": {"tplab.checks"},
             "tplab.checks.explorer": {"tplab.widgets", "tplab.rank.explore_step"}}
    assert barred_arrows(graph) == ["tplab.core.answers.qk_norm -> tplab.rank.qk_norm_step",
                                    "tplab.viz.check -> tplab.checks",
                                    "tplab.widgets -> tplab.checks.grad"]


# --- the sides -----------------------------------------------------------------------------


def test_every_public_name_imports_the_standard_way(fresh):
    # `import tplab.NAME` and `from tplab.NAME import x` for every public module, in a fresh
    # interpreter (here the notebook side is loaded already), and `from tplab.training import
    # steps` for a package's own modules: real modules at those paths, no aliases
    assert fresh["public"] == len(tplab.MODULES) >= 26
    assert all(tplab.MODULES[short] == f"tplab.{short}" for short in tplab.MODULES)


def test_what_a_learner_reads_imports_only_public_names():
    # the notebooks and the README never name the internals (tplab.core); the docs, which
    # also describe the internals to developers, never import them in an example
    repo = ROOT.parent
    learner = [*repo.glob("notebooks/**/*.ipynb"), repo / "README.md"]
    docs = list(repo.glob("docs/*.md"))
    assert len(learner) > 15 and docs
    found = [f"{path.relative_to(repo)}:{n}"
             for paths, pattern in ((learner, r"tplab[./]core\b"),
                                    (docs, r"(from|import) tplab\.core\b"))
             for path in paths for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(pattern, line)]
    assert not found, f"internal imports where a learner reads them: {found}"


def test_the_sides_follow_from_the_path():
    assert side_of("tplab") == side_of("tplab.plans") == BOTH
    assert side_of("tplab.rank.runner") == RANK
    assert side_of("tplab.lab.launch") == side_of("tplab.widgets") == NOTEBOOK
    assert side_of("tplab.checks.grad") == side_of("tplab.testing") == NOTEBOOK
    assert side_of("tplab.plans") == side_of("tplab.megatron.layers") == BOTH
    assert side_of("tplab.widgets") == side_of("tplab.hf_models") == NOTEBOOK


# What the rank side may load of IPython and ipyparallel: a rank is an ipyparallel engine,
# an IPython kernel (tplab.rank.runner asks it for get_ipython, tplab.rank.stream subclasses
# its OutStream), and tplab.rank.entry starts the engine and controller processes. Both
# sides (tplab/core/) load none of them.
NOTEBOOK_PACKAGES = ("IPython", "ipykernel", "ipyparallel", "plotly", "ipywidgets")
RANK_MAY_IMPORT = ("IPython", "ipykernel", "ipyparallel.engine", "ipyparallel.controller")
# The one import of the notebook side on another side, with its reason: `import tplab` in
# IPython registers %%ranks (tplab/__init__.py; not on a rank, whose engine runs IPython too)
ALLOWED = {("tplab", "tplab.lab.magics")}


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def notebook_imports(module: str, path: pathlib.Path, modules) -> list[str]:
    """The notebook side's modules a rank-side or both-sides file imports, with their lines."""
    allowed = RANK_MAY_IMPORT if side_of(module) == RANK else ()
    where = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path
    return [f"{where}:{line}: {dep}"
            for dep, line in imports_of(module, path, modules).items()
            if (module, dep) not in ALLOWED and not under(dep, allowed)
            and (side_of(dep) == NOTEBOOK if dep in modules else under(dep, NOTEBOOK_PACKAGES))]


def test_the_rank_side_and_both_sides_name_nothing_of_the_notebook_side():
    modules = module_files()
    bad = [line for m, path in sorted(modules.items()) if side_of(m) in (RANK, BOTH)
           for line in notebook_imports(m, path, modules)]
    assert not bad, "the rank side and tplab/core/ import the notebook side:\n" + "\n".join(bad)


def test_the_side_check_sees_a_notebook_import(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import torch\n\n\ndef show():\n    import plotly.graph_objects\n"
                    "    from tplab.checks.grad import grad_check\n"
                    "    from IPython import display\n")
    modules = {**module_files(), "tplab.core.x": path, "tplab.rank.x": path}
    assert [line.rsplit(" ", 1)[1] for line in notebook_imports("tplab.core.x", path, modules)] \
        == ["plotly.graph_objects", "tplab.checks.grad", "IPython"]
    # a rank is an IPython kernel: IPython is allowed there, the rest is not
    assert [line.rsplit(" ", 1)[1] for line in notebook_imports("tplab.rank.x", path, modules)] \
        == ["plotly.graph_objects", "tplab.checks.grad"]


PUBLIC = ("import sys, tplab\n"
          "for short in tplab.MODULES:\n"
          "    exec(f'import tplab.{short}')\n"
          "    assert sys.modules[f'tplab.{short}'] is getattr(tplab, short), short\n"
          "from tplab.training import steps\n"
          "from tplab.megatron import ColumnParallelLinear\n"
          "from tplab.lessons import require_world_size\n"
          "result = len(tplab.MODULES)\n")


def importing(modules: list[str]) -> str:
    """Code that imports `modules` and leaves the names of sys.modules in `result`. A
    tplab.frameworks adapter whose framework is not installed (its ImportError says what to
    pip install) is left out."""
    return ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    try: importlib.import_module(m)\n"
            "    except ImportError as e:\n"
            "        if not (m.startswith('tplab.frameworks.') and 'pip install' in str(e)):\n"
            "            raise\n"
            "result = sorted(sys.modules)\n")


# One interpreter serves every check: it imports torch (no side's module, and the bulk of
# each check's time), then forks a fresh child for each piece of code, one after another,
# which holds nothing of tplab until the code runs. The child leaves `result` in a file.
FORKS = """
import json, os, sys, traceback
import torch
jobs, out = json.loads(sys.argv[1]), sys.argv[2]
failed = 0
for name, code in jobs.items():
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            scope = {}
            exec(code, scope)
            with open(os.path.join(out, name + '.json'), 'w') as f:
                json.dump(scope['result'], f)
        except BaseException:
            status = 1
            sys.stderr.write(f'{name}:\\n' + traceback.format_exc())
        sys.stderr.flush()
        os._exit(status)
    failed += os.waitpid(pid, 0)[1] != 0
sys.exit(failed)
"""


def run_fresh(jobs: dict[str, str], *, env=None) -> dict:
    """{name: the `result` its code left} for each piece of code, each run in a fresh
    interpreter (a subprocess: this test process has imported the notebook side already)."""
    with tempfile.TemporaryDirectory(prefix="tplab-imports-") as out:
        done = subprocess.run([sys.executable, "-c", FORKS, json.dumps(jobs), out],
                              capture_output=True, text=True, cwd=ROOT.parent, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return {name: json.loads(pathlib.Path(out, name + ".json").read_text())
                for name in jobs}


def loaded_after_import(modules: list[str], *, env=None) -> list[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    return run_fresh({"loaded": importing(modules)}, env=env)["loaded"]


# tplab.rank.stream subclasses the engine kernel's OutStream: test_a_ranks_output_stream_... below
RANK_SIDE = sorted(m for m in module_files()
                   if side_of(m) in (RANK, BOTH) and m != "tplab.rank.stream")
NOTEBOOK_ONLY = (*NOTEBOOK_PACKAGES, *sorted(m for m in module_files()
                                             if side_of(m) == NOTEBOOK))


def notebook_side(loaded: list[str], allowed: tuple = ()) -> list[str]:
    return [m for m in loaded if under(m, NOTEBOOK_ONLY) and not under(m, allowed)]


@pytest.fixture(scope="module")
def fresh() -> dict:
    """What each check of a fresh interpreter found, from one subprocess (run_fresh)."""
    return run_fresh({"rank_side": importing(RANK_SIDE),
                      "stream": importing(["tplab.rank.stream"]),
                      "lab_streams": importing(["tplab.lab.streams"]), "public": PUBLIC})


def test_the_rank_side_loads_nothing_of_the_notebook_side(fresh):
    loaded = fresh["rank_side"]
    assert "tplab.rank.runner" in loaded and "torch" in loaded
    found = notebook_side(loaded)
    if found:  # which rank-side module pulled it in
        culprits = {m: notebook_side(loaded_after_import([m])) for m in RANK_SIDE}
        found = {m: f for m, f in culprits.items() if f}
    assert not found, f"rank-side modules that load the notebook side: {found}"


def test_a_ranks_output_stream_needs_only_the_engines_kernel(fresh):
    # the engine's out_stream_factory subclasses ipykernel's OutStream (IPython comes with
    # it, as in every engine); the ipyparallel client, plotly and widgets stay out
    loaded = fresh["stream"]
    assert "ipykernel.iostream" in loaded
    assert notebook_side(loaded, allowed=("IPython", "ipykernel")) == []


def test_the_load_check_sees_a_notebook_import(fresh):
    assert notebook_side(fresh["lab_streams"]) != []
    # each check's interpreter is fresh (run_fresh): what tplab.lab.streams loaded is not
    # in the one that imported the rank side after it
    assert "tplab.lab.streams" not in fresh["rank_side"] and "tplab.lab.streams" in fresh[
        "lab_streams"]


def test_every_public_short_name_is_its_homes_module():
    # `tplab.plans`, `from tplab import models`: each short name is the module at its home
    for short, home in tplab.MODULES.items():
        assert getattr(tplab, short) is sys.modules[home], short
    assert set(tplab.MODULES) <= set(tplab.__all__)

