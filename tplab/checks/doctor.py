"""`python -m tplab doctor [--json]`: is this machine ready for the workshop?

It prints the versions, cores, memory, GPUs and the backend "auto" picks; runs a 2-rank smoke
test (launch, an all-reduce, one traced Megatron MLP step and its grad_check); reports the
largest world size the machine's memory holds, whether JupyterLab has the widget and plotly
renderers, and the platform notes that apply (tplab.platforms). Exit status 0 when the
machine is ready, 1 with the fix otherwise; `--json` prints one object a teacher can
collect from every machine in the room.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as std_platform
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version

import psutil
from jupyter_core.paths import jupyter_path

import tplab
from tplab import platforms
from tplab.lab.arguments import resolve_backend

GiB = 2**30
SMOKE_WORLD = 2
MAX_WORLD = 16  # the notebooks never need more


@dataclass
class Check:
    """One line of the report: `ok`, what was found, and how to fix it when not ok."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def _version(module: str) -> str | None:
    try:
        return version(module)
    except Exception:
        return None


def versions() -> dict[str, str | None]:
    return {"python": std_platform.python_version(), "torch": _version("torch"),
            "tplab": tplab.__version__, "ipyparallel": _version("ipyparallel"),
            "jupyterlab": _version("jupyterlab"), "ipywidgets": _version("ipywidgets"),
            "plotly": _version("plotly")}


def machine() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        usable = os.cpu_count() or 1
    mem = psutil.virtual_memory()
    gpus = []
    try:
        # deferred: the doctor reports a torch that cannot load (broken CUDA libraries raise
        # here) instead of failing before it prints anything
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install must not stop the doctor
        pass
    return {"os": f"{std_platform.system()} {std_platform.release()}", "cores": usable,
            "memory_gib": round(mem.total / GiB, 1), "available_gib": round(mem.available / GiB, 1),
            "gpus": gpus}


def auto_backend(world_size: int = SMOKE_WORLD) -> str:
    return resolve_backend("auto", world_size)


def largest_world_size(available_bytes: float, rank_bytes: int | None) -> int:
    """The largest power of two of ranks whose memory fits in 70% of what is available
    (about 400 MiB a rank when it could not be measured), at most MAX_WORLD."""
    per_rank = rank_bytes or 400 * 2**20
    fits = int(0.7 * available_bytes // per_rank)
    n = 1
    while n * 2 <= min(fits, MAX_WORLD):
        n *= 2
    return n if fits >= 1 else 0


def renderers() -> Check:
    """Whether JupyterLab finds the ipywidgets manager and plotly's renderer extensions."""
    wanted = {"widgets": "@jupyter-widgets/jupyterlab-manager", "plotly": "jupyterlab-plotly"}
    found = {k: any(os.path.exists(os.path.join(d, v, "package.json"))
                    for d in jupyter_path("labextensions")) for k, v in wanted.items()}
    missing = [wanted[k] for k, ok in found.items() if not ok]
    return Check("jupyterlab_renderers", not missing,
                 "widgets and plotly renderers installed" if not missing else
                 f"missing JupyterLab extensions: {', '.join(missing)}",
                 "" if not missing else "pip install 'ipywidgets>=8' 'plotly>=5.20' into the "
                                        "Python that runs JupyterLab, then restart it")


def diagnose(run_smoke: bool = True) -> dict:
    """Everything the doctor reports, as one JSON-able dict; `ready` is the verdict."""
    started = time.perf_counter()
    p = platforms.detect()
    info = {"versions": versions(), "machine": machine()}
    checks: list[Check] = []
    try:
        info["backend"] = auto_backend()
        checks.append(Check("backend", True, f'"auto" picks {info["backend"]}'))
    except Exception as err:
        info["backend"] = None
        checks.append(Check("backend", False, str(err), "install a torch with gloo"))
    for note in platforms.notes(p, nccl=info["backend"] == "nccl"):
        checks.append(Check(f"platform: {note.name}", not note.problem, note.text, note.fix))
    checks.append(renderers())
    facts: dict = {}
    if run_smoke:
        # deferred: the smoke test loads torch; `--no-smoke` reports without it (machine())
        from tplab.checks.smoke import smoke_test

        smoke, facts = smoke_test(SMOKE_WORLD)
        checks += [Check(**r) for r in smoke]
    available = info["machine"]["available_gib"] * GiB
    info["largest_world_size"] = largest_world_size(available, facts.get("rank_bytes"))
    info["suggested_world_size"] = min(platforms.suggested_world_size(p),
                                       info["largest_world_size"] or 1)
    if info["largest_world_size"] < 2:
        checks.append(Check("memory", False, f"{available / GiB:.1f} GiB available: not enough "
                            "for 2 ranks", "close other programs or use a machine with more "
                                           "memory (Colab works)"))
    info["checks"] = [asdict(c) for c in checks]
    info["ready"] = all(c.ok for c in checks)
    info["seconds"] = round(time.perf_counter() - started, 1)
    info.update(facts)
    return info


def render(info: dict) -> str:
    v, m = info["versions"], info["machine"]
    lines = ["tplab doctor",
             "  versions: " + ", ".join(f"{k} {val or 'missing'}" for k, val in v.items()),
             f"  machine: {m['os']}, {m['cores']} cores, {m['memory_gib']} GiB memory "
             f"({m['available_gib']} available), GPUs: {', '.join(m['gpus']) or 'none'}",
             f"  largest world size: {info['largest_world_size']} "
             f"(notebooks: use world_size={info['suggested_world_size']})"]
    for c in info["checks"]:
        lines.append(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}")
        if not c["ok"] and c["fix"]:
            lines.append(f"         fix: {c['fix']}")
    verdict = "READY" if info["ready"] else "NOT READY: fix the lines marked FAIL"
    lines.append(f"{verdict} ({info['seconds']} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tplab doctor",
                                     description="Check that this machine can run the lab.")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--no-smoke", action="store_true",
                        help="skip the 2-rank smoke test (versions and platform only)")
    args = parser.parse_args(argv)
    info = diagnose(run_smoke=not args.no_smoke)
    print(json.dumps(info, indent=1) if args.json else render(info))
    sys.stdout.flush()
    return 0 if info["ready"] else 1
