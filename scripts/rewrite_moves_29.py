"""One-off for #29: rewrite imports, module names and paths to the moved modules (tplab/core/,
tplab/checks/, ...). For merging branches made before the moves; delete once they are in.

    python3 scripts/rewrite_moves_29.py FILE...   (.py, .md, .ipynb; rewrites in place)

Then `ruff check --fix` sorts the imports it rewrote.
"""
import json
import pathlib
import re
import sys

CORE = ["errors", "output", "transfer", "placements", "ops", "pytrees", "mesh", "models", "rng",
        "plans", "parallel_styles", "hf", "tracing", "causes", "explain", "layouts", "fsdp",
        "fsdp_layout", "checkpointing", "compiling", "pairing", "memory_use", "lessons",
        "platforms"]
MOVES = {f"tplab.{m}": f"tplab.core.{m}" for m in CORE}
MOVES.update({
    "tplab.megatron": "tplab.core.megatron",
    "tplab.megatron.layers": "tplab.core.megatron.layers",
    "tplab.megatron.operators": "tplab.core.megatron.operators",
    "tplab.plan_check": "tplab.core.plan_check.fit",
    "tplab.handovers": "tplab.core.plan_check.handovers",
    "tplab.layout_flow": "tplab.core.plan_check.tags",
    "tplab.layout_contracts": "tplab.core.plan_check.style_contracts",
    "tplab.training": "tplab.core.training",
    "tplab.training.clip": "tplab.core.training.clip",
    "tplab.training.noise": "tplab.core.training.noise",
    "tplab.training.lm": "tplab.core.training.lm",
    "tplab.training.steps": "tplab.core.training.steps",
    "tplab.training.check": "tplab.checks.train",
    "tplab.training.live": "tplab.checks.train_live",
    "tplab.training.report": "tplab.checks.train_report",
    "tplab.training.band": "tplab.checks.train_band",
    "tplab.check": "tplab.checks.grad",
    "tplab.report": "tplab.checks.grad_report",
    "tplab.fsdp_report": "tplab.checks.fsdp_report",
    "tplab.hf_models": "tplab.checks.hf_models",
    "tplab.cli_check": "tplab.checks.cli",
    "tplab.doctor": "tplab.checks.doctor",
    "tplab.smoke": "tplab.checks.smoke",
    "tplab.widgets": "tplab.viz.widgets",
    "tplab.exercises.steps": "tplab.rank.exercise_steps",
    "tplab.exercises.qk_norm_step": "tplab.rank.qk_norm_step",
    "tplab.exercises.solutions": "tplab.core.answers.solutions",
    "tplab.exercises.mistakes": "tplab.core.answers.mistakes",
    "tplab.exercises.clipping": "tplab.core.answers.clipping",
})
PACKAGES = {"tplab.megatron", "tplab.training"}
NEW_PACKAGES = {"tplab.core.megatron", "tplab.core.training"}  # the new ones


def path_of(mod: str, package: bool) -> str:
    p = mod.replace(".", "/")
    return p + "/__init__.py" if package else p + ".py"

# public short names: attributes of tplab (tplab/__init__.py), for notebooks and users
PUBLIC = {"megatron", "models", "plans", "rng", "mesh", "hf", "hf_models", "parallel_styles",
          "plan_check", "tracing", "fsdp", "fsdp_report", "checkpointing", "compiling",
          "platforms", "training", "lessons", "causes", "explain", "layouts", "widgets"}
NEW = dict(MOVES)
NEW["tplab.plan_check"] = "tplab.core.plan_check"  # the package (re-exports fit's names)


def home(mod):
    """new name of dotted module mod (or a name inside it), or None."""
    best = None
    for old in NEW:
        if mod == old or mod.startswith(old + "."):
            if best is None or len(old) > len(best):
                best = old
    return None if best is None else NEW[best] + mod[len(best):]


def rewrite_from_tplab(line_indent, base, names, keep_public):
    """`from tplab import a, b as c` -> lines."""
    groups, order = {}, []
    for item in names:
        name = item.split(" as ")[0].strip()
        full = f"{base}.{name}"
        if base == "tplab" and keep_public and name in PUBLIC:
            new = None
        elif full in NEW:
            new = NEW[full]
        else:
            new = None
        if new is None:
            parent, leaf = (home(base) or base), None
        else:
            parent, _, leaf = new.rpartition(".")
        text = item.strip()
        if leaf is not None and leaf != name:
            alias = item.split(" as ")[1].strip() if " as " in item else name
            text = f"{leaf} as {alias}"
        if parent not in groups:
            groups[parent] = []
            order.append(parent)
        groups[parent].append(text)
    order.sort(key=lambda p: (p != "tplab", p))
    return [f"{line_indent}from {p} import {', '.join(sorted(groups[p], key=str.lower))}"
            for p in order]


FROM_TPLAB = re.compile(r"^(\s*)from (tplab(?:\.\w+)*) import ([^()\n#]+?)(\s*#.*)?$", re.M)
FROM_MOD = re.compile(r"^(\s*)from (tplab(?:\.\w+)+) import", re.M)
IMPORT_MOD = re.compile(r"^(\s*)import (tplab(?:\.\w+)+)", re.M)


def rewrite_code(src, keep_public):
    def from_tplab(m):
        indent, base, comment = m.group(1), m.group(2), m.group(4) or ""
        names = m.group(3).split(",")
        lines = rewrite_from_tplab(indent, base, names, keep_public)
        if len(lines) == 1 and lines[0].startswith(f"{indent}from {base} import "):
            return m.group(0)  # nothing in it moved
        lines[-1] += comment
        return "\n".join(lines)
    src = FROM_TPLAB.sub(from_tplab, src)
    src = FROM_MOD.sub(lambda m: f"{m.group(1)}from {home(m.group(2)) or m.group(2)} import", src)
    src = IMPORT_MOD.sub(lambda m: f"{m.group(1)}import {home(m.group(2)) or m.group(2)}", src)
    return src


# dotted mentions of modules that are no public name any more
DOTTED = sorted((o for o in NEW if o.split(".")[1] not in PUBLIC or o.count(".") > 1),
                key=len, reverse=True)
DOTTED_RE = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, DOTTED)) + r")(?![\w])")
PATHS = {}
for old, new in MOVES.items():
    PATHS[path_of(old, old in PACKAGES)] = path_of(new, new in NEW_PACKAGES)
PATHS["tplab/megatron/"] = "tplab/core/megatron/"
PATHS["tplab/plan_check.py"] = "tplab/core/plan_check/fit.py"
PATH_RE = re.compile(r"(?<![\w/])("
                     + "|".join(map(re.escape, sorted(PATHS, key=len, reverse=True))) + r")")


def rewrite_text(src):
    src = DOTTED_RE.sub(lambda m: m.group(1) if m.group(1).endswith(".training")
                        else NEW[m.group(1)], src)
    src = PATH_RE.sub(lambda m: PATHS[m.group(1)], src)
    # a package path named without its __init__.py
    src = src.replace("tplab/training/", "tplab/core/training/")
    return src


def main(paths):
    for p in map(pathlib.Path, paths):
        old = p.read_text()
        if p.suffix == ".py":
            new = rewrite_text(rewrite_code(old, False))  # code imports from the homes
        elif p.suffix == ".ipynb":
            nb = json.loads(old)
            for cell in nb["cells"]:
                s = "".join(cell["source"])
                t = rewrite_text(rewrite_code(s, True) if cell["cell_type"] == "code" else s)
                if t != s:
                    cell["source"] = t.splitlines(keepends=True)
            new = json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
            if json.loads(new) == json.loads(old):
                new = old
        else:
            new = rewrite_text(old)
        if new != old:
            p.write_text(new)
            print("rewrote", p)


if __name__ == "__main__":
    main(sys.argv[1:])
