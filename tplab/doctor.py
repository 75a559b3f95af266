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

from tplab import platforms

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
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def versions() -> dict[str, str | None]:
    import tplab

    return {"python": std_platform.python_version(), "torch": _version("torch"),
            "tplab": tplab.__version__, "ipyparallel": _version("ipyparallel"),
            "jupyterlab": _version("jupyterlab"), "ipywidgets": _version("ipywidgets"),
            "plotly": _version("plotly")}


def machine() -> dict:
    import psutil

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        usable = os.cpu_count() or 1
    mem = psutil.virtual_memory()
    gpus = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install must not stop the doctor
        pass
    return {"os": f"{std_platform.system()} {std_platform.release()}", "cores": usable,
            "memory_gib": round(mem.total / GiB, 1), "available_gib": round(mem.available / GiB, 1),
            "gpus": gpus}


def auto_backend(world_size: int = SMOKE_WORLD) -> str:
    from tplab.lab.validate import resolve_backend

    return resolve_backend("auto", world_size)


def _mlp_step(cfg):
    """Rank side: one traced Megatron MLP step."""
    import torch

    import tplab
    from tplab import megatron, models

    model = megatron.parallelize(models.MLP(cfg), tplab.make_mesh())
    x = models.make_input(cfg).requires_grad_()
    with tplab.trace() as t:
        model(x).pow(2).sum().backward()
    return {"counts": t.counts(), "finite": bool(torch.isfinite(x.grad).all())}


def _all_reduce():
    import torch
    import torch.distributed as dist

    x = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    return x.tolist()


def _rank_memory(lab) -> int | None:
    """Bytes one rank holds of its own (USS: pages shared with the fork server not counted)."""
    import psutil

    pids = getattr(lab, "rank_pids", None) or []
    sizes = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            info = p.memory_full_info()
            sizes.append(getattr(info, "uss", info.rss))
        except (psutil.Error, OSError):
            continue
    return max(sizes) if sizes else None


def smoke_test(world_size: int = SMOKE_WORLD, timeout: float = 30) -> tuple[list[Check], dict]:
    """Launch `world_size` ranks, all-reduce, a traced Megatron MLP step and its grad_check."""
    import functools

    import tplab
    from tplab import megatron, models

    checks, facts = [], {}
    started = time.perf_counter()
    try:
        lab = tplab.launch(world_size, timeout=timeout)
    except Exception as err:
        checks.append(Check("launch", False, f"{type(err).__name__}: {err}",
                            "see the platform notes above; `python -m tplab doctor` again "
                            "after fixing; report the message to the teacher"))
        return checks, facts
    try:
        facts["launch_s"] = round(time.perf_counter() - started, 2)
        checks.append(Check("launch", True, f"{world_size} ranks ({lab.backend}) in "
                                            f"{facts['launch_s']} s"))
        got = lab.run(_all_reduce)
        want = [float(world_size * (world_size + 1) / 2)] * 4
        ok = all(r == want for r in got)
        checks.append(Check("all_reduce", ok, f"every rank got {got[0]}" if ok else
                            f"ranks got {got}, expected {want}",
                            "" if ok else "the ranks cannot sum: check the network notes"))
        cfg = models.Config(dim=16, hidden_dim=32 * world_size)
        step = lab.run(_mlp_step, cfg)
        want_counts = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
        ok = all(s["counts"] == want_counts and s["finite"] for s in step)
        checks.append(Check("megatron_step", ok, f"traced {step[0]['counts']}",
                            "" if ok else "tracing or the MLP step is broken: reinstall tplab"))
        report = tplab.grad_check(lab, functools.partial(models.MLP, cfg), megatron.parallelize,
                                  functools.partial(models.make_input, cfg))
        checks.append(Check("grad_check", report.ok, report.summary(),
                            "" if report.ok else "gradients differ from one device: "
                                                 "reinstall tplab and torch"))
        facts["rank_bytes"] = _rank_memory(lab)
    except Exception as err:
        checks.append(Check("smoke_test", False, f"{type(err).__name__}: {err}",
                            "the ranks started but a step failed: send this output to the "
                            "teacher"))
    finally:
        lab.shutdown()
    facts["smoke_s"] = round(time.perf_counter() - started, 2)
    return checks, facts


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
    from jupyter_core.paths import jupyter_path

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
        smoke, facts = smoke_test()
        checks += smoke
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
