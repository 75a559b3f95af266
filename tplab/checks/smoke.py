"""The doctor's smoke test (`python -m tplab doctor`): launch 2 ranks, all-reduce, one
traced Megatron MLP step and its grad_check, and how much memory a rank holds."""

from __future__ import annotations

import functools
import time

import psutil

import tplab
from tplab import megatron, models
from tplab.lab.contract import Ranks
from tplab.rank.doctor_step import all_reduce_ranks, mlp_step


def _rank_memory(lab: Ranks) -> int | None:
    """Bytes one rank holds of its own (USS: pages shared with the fork server not counted)."""
    pids = lab.rank_pids
    sizes = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            info = p.memory_full_info()
            sizes.append(getattr(info, "uss", info.rss))
        except (psutil.Error, OSError):
            continue
    return max(sizes) if sizes else None


def row(name: str, ok: bool, detail: str, fix: str = "") -> dict:
    """One line of the doctor's report (tplab.checks.doctor.Check's fields)."""
    return {"name": name, "ok": ok, "detail": detail, "fix": fix}


def smoke_test(world_size: int, timeout: float = 30) -> tuple[list[dict], dict]:
    """Launch `world_size` ranks, all-reduce, a traced Megatron MLP step and its grad_check;
    returns the report's rows (tplab.checks.doctor makes them Checks) and the facts measured."""
    checks, facts = [], {}
    started = time.perf_counter()
    try:
        lab = tplab.launch(world_size, timeout=timeout)
    except Exception as err:
        checks.append(row("launch", False, f"{type(err).__name__}: {err}",
                            "see the platform notes above; `python -m tplab doctor` again "
                            "after fixing; report the message to the teacher"))
        return checks, facts
    try:
        facts["launch_s"] = round(time.perf_counter() - started, 2)
        checks.append(row("launch", True, f"{world_size} ranks ({lab.backend}) in "
                                            f"{facts['launch_s']} s"))
        got = lab.run(all_reduce_ranks)
        want = [float(world_size * (world_size + 1) / 2)] * 4
        ok = all(r == want for r in got)
        checks.append(row("all_reduce", ok, f"every rank got {got[0]}" if ok else
                            f"ranks got {got}, expected {want}",
                            "" if ok else "the ranks cannot sum: check the network notes"))
        cfg = models.Config(dim=16, hidden_dim=32 * world_size)
        step = lab.run(mlp_step, cfg)
        want_counts = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
        ok = all(s["counts"] == want_counts and s["finite"] for s in step)
        checks.append(row("megatron_step", ok, f"traced {step[0]['counts']}",
                            "" if ok else "tracing or the MLP step is broken: reinstall tplab"))
        report = tplab.grad_check(lab, functools.partial(models.MLP, cfg), megatron.parallelize,
                                  functools.partial(models.make_input, cfg))
        checks.append(row("grad_check", report.ok, report.summary(),
                            "" if report.ok else "gradients differ from one device: "
                                                 "reinstall tplab and torch"))
        facts["rank_bytes"] = _rank_memory(lab)
    except Exception as err:
        checks.append(row("smoke_test", False, f"{type(err).__name__}: {err}",
                            "the ranks started but a step failed: send this output to the "
                            "teacher"))
    finally:
        lab.shutdown()
    facts["smoke_s"] = round(time.perf_counter() - started, 2)
    return checks, facts
