"""The GPU path, checked on a machine with NVIDIA GPUs (scripts/gpu_check.sh runs this).

    python benchmarks/gpu.py [--steps 20] [--all | --memory --rates] [--json PATH]

Checks, each printed as PASS, FAIL or SKIP with what it saw (exit status 1 on a FAIL):
1. backend="auto" picks NCCL when every rank can have its own GPU, gloo otherwise
   (tplab.lab.arguments.resolve_backend, and a 1-rank lab's `backend`).
2. A 1-rank NCCL lab runs a traced tensor-parallel step (tplab.trace around an MLP under
   the Megatron plan on a CUDA mesh).
3. Two and four ranks share one GPU through gloo with CUDA tensors (an all-reduce of a CUDA
   tensor gives the right sum), or fail with a clear error.
4. grad_check runs on CUDA (a 1-rank NCCL lab against the single-device reference).
5. With 2 or more GPUs: the same TP step run by a lab over NCCL and by torchrun, median
   step time of each, ratio lab / torchrun (goal: <= 1.02x).

With --memory (benchmarks/gpu_memory.py): tplab.memory's model against the CUDA caching
allocator in each rank (notebooks 10 and 13). With --rates (benchmarks/gpu_rates.py): bf16
GEMM, flash attention and copy bandwidth against the H200 preset's constants. --all: both.
--json PATH: every number, with the GPU, driver, CUDA and torch, as JSON. A short table is
printed last; each check and measurement runs on its own (a failure is a FAIL row, with its
reason, and the next one runs).

On a machine without a CUDA GPU it prints why and exits 0 (nothing to check). It runs under
any torch >= 2.10 with CUDA (a GPU box's own torch, with tplab's other requirements on
PYTHONPATH: scripts/gpu_check.sh says how).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

import torch

RESULTS: list[tuple[str, str, str]] = []


def report(name: str, status: str, detail: str) -> None:
    RESULTS.append((name, status, detail))
    print(f"[{status}] {name}: {detail}", flush=True)


def check(name: str):
    def wrap(fn):
        def run(*args):
            started = time.perf_counter()
            try:
                status, detail = fn(*args)
            except Exception as exc:  # noqa: BLE001 - a check that raised is a FAIL, said so
                tb = traceback.format_exc(limit=-3)
                status, detail = "FAIL", f"{type(exc).__name__}: {exc}\n{tb}"
            report(name, status, f"{detail} ({time.perf_counter() - started:.1f} s)")
        return run
    return wrap


def tp_step(steps: int, dim: int = 1024, hidden: int = 4096, batch: int = 32) -> list[float]:
    """On a rank: Megatron's MLP under the lab's plan on a CUDA mesh; forward, backward and
    an SGD step, `steps` times after 3 warm-up steps. Returns each step's seconds."""
    import time

    import torch
    import torch.distributed as dist

    import tplab
    from tplab import plans

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.w1 = torch.nn.Linear(dim, hidden)
    model.act = torch.nn.GELU()
    model.w2 = torch.nn.Linear(hidden, dim)
    mesh = tplab.make_mesh(tp=dist.get_world_size())
    model = tplab.apply_plan(model.cuda(), mesh, plans.mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, dim, device="cuda")
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - started)
    return times


@check("1. backend='auto' picks NCCL with a GPU per rank, else gloo")
def check_auto(gpus: int):
    from tplab.lab.arguments import resolve_backend

    picks = {n: resolve_backend("auto", n) for n in (1, gpus, gpus + 1)}
    want = {1: "nccl", gpus: "nccl", gpus + 1: "gloo"}
    if picks != want:
        return "FAIL", f"resolve_backend gave {picks}, want {want}"
    import tplab

    with tplab.launch(1, backend="auto") as lab:
        got = lab.backend, lab.run(lambda: __import__("torch").distributed.get_backend())[0]
    if got != ("nccl", "nccl"):
        return "FAIL", f"a 1-rank auto lab has backend {got}"
    return "PASS", f"{gpus} GPU(s): {picks}; a 1-rank auto lab runs nccl"


def traced_step():
    import torch

    import tplab
    from tplab import plans

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.w1 = torch.nn.Linear(16, 32)
    model.act = torch.nn.GELU()
    model.w2 = torch.nn.Linear(32, 16)
    model = tplab.apply_plan(model.cuda(), tplab.make_mesh(tp=1), plans.mlp())
    x = torch.randn(4, 16, device="cuda")
    with tplab.trace() as t:
        loss = model(x).sum()
        loss.backward()
    return {"device": str(model.w1.weight.device), "counts": t.counts(),
            "loss": float(loss)}


@check("2. a 1-rank NCCL lab runs a traced TP step")
def check_traced():
    import tplab

    with tplab.launch(1, backend="nccl") as lab:
        got = lab.run(traced_step)[0]
    if not got["device"].startswith("cuda"):
        return "FAIL", f"parameters on {got['device']}"
    return "PASS", f"parameters on {got['device']}, collectives {got['counts']}"


def cuda_all_reduce():
    import torch
    import torch.distributed as dist

    x = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return x.cpu().tolist()


def shared_gpu(n: int):
    import tplab

    with tplab.launch(n, backend="gloo") as lab:
        try:
            got = lab.run(cuda_all_reduce)
        except tplab.LabError as exc:
            first = str(exc).strip().splitlines()[-1]
            return "PASS", f"a clear error instead: {type(exc).__name__}: {first}"
    want = [[float(n * (n + 1) // 2)] * 4] * n
    if got != want:
        return "FAIL", f"all-reduce of CUDA tensors through gloo gave {got}, want {want}"
    return "PASS", f"all-reduce of CUDA tensors through gloo is right on all {n} ranks"


@check("3. two ranks share one GPU through gloo with CUDA tensors")
def check_shared_gpu():
    return shared_gpu(2)


@check("3b. four ranks share one GPU through gloo with CUDA tensors")
def check_shared_gpu4():
    return shared_gpu(4)


def build_mlp():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.w1 = torch.nn.Linear(16, 32)
    model.act = torch.nn.GELU()
    model.w2 = torch.nn.Linear(32, 16)
    return model


def mlp_input():
    import torch

    torch.manual_seed(1)
    return torch.randn(4, 16)


@check("4. grad_check on CUDA")
def check_grad():
    import tplab
    from tplab import plans

    with tplab.launch(1, backend="nccl") as lab:
        report_ = tplab.grad_check(lab, build_mlp, plans.mlp(), mlp_input, atol=1e-4)
    if not report_.ok:
        return "FAIL", f"max_abs {report_.max_abs:g}; rows {report_.rows}"
    return "PASS", f"{len(report_.rows)} rows agree (max_abs {report_.max_abs:.2e})"


TORCHRUN = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {here!r})
from gpu import tp_step
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
times = tp_step({steps})
if dist.get_rank() == 0:
    print("TIMES " + json.dumps(times), flush=True)
dist.destroy_process_group()
"""


@check("5. a lab's NCCL TP step against torchrun's (goal <= 1.02x)")
def check_vs_torchrun(gpus: int, steps: int):
    if gpus < 2:
        return "SKIP", f"needs 2 or more GPUs, this machine has {gpus}"
    import tplab

    n = 2
    with tplab.launch(n, backend="nccl") as lab:
        lab_times = lab.run(tp_step, steps)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TORCHRUN.format(here=os.path.dirname(os.path.abspath(__file__)), steps=steps))
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                              f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
                              "--master-port=0", f.name],
                             capture_output=True, text=True, timeout=240)
    finally:
        os.unlink(f.name)
    line = next((x for x in out.stdout.splitlines() if x.startswith("TIMES ")), None)
    if line is None:
        return "FAIL", f"torchrun failed: {out.stderr[-2000:]}"
    import json

    base = json.loads(line[6:])
    lab_s, base_s = statistics.median(lab_times), statistics.median(base)
    ratio = lab_s / base_s
    status = "PASS" if ratio <= 1.02 else "FAIL"
    return status, (f"median step: lab {lab_s * 1e3:.2f} ms, torchrun {base_s * 1e3:.2f} ms, "
                    f"ratio {ratio:.3f}x over {steps} steps, world {n}")


def environment() -> dict:
    """The GPU, driver, CUDA and torch this run saw (nvidia-smi is only read)."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "nccl": None, "cudnn": torch.backends.cudnn.version(), "gpus": []}
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a build without NCCL
        pass
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        env["gpus"].append({"name": p.name, "total_memory": p.total_memory,
                            "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"})
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = q.stdout.strip()
        env["driver"] = q.stdout.split(",")[1].strip() if q.stdout.count(",") else None
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"not read: {exc}"
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory", action="store_true", help="tplab.memory vs the allocator")
    parser.add_argument("--rates", action="store_true", help="GEMM, attention, bandwidth")
    parser.add_argument("--all", action="store_true", help="--memory and --rates")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {gpus}", flush=True)
    if gpus == 0:
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        print(f"SKIP: {why}; the GPU checks need a machine with NVIDIA GPUs and a CUDA "
              "build of torch (>= 2.10). Nothing was checked.")
        return 0
    for i in range(gpus):
        print(f"  cuda:{i} {torch.cuda.get_device_name(i)}", flush=True)
    results: dict = {"environment": environment()}
    print(f"  {results['environment'].get('nvidia_smi')}", flush=True)
    started = time.perf_counter()
    check_auto(gpus)
    check_traced()
    check_shared_gpu()
    check_shared_gpu4()
    check_grad()
    check_vs_torchrun(gpus, args.steps)
    rows = list(RESULTS)

    def save():   # after each section, so that a run cut short keeps what it measured
        results["checks"] = [{"name": n, "status": s, "detail": d} for n, s, d in RESULTS]
        results["summary"] = [{"name": n, "status": s, "detail": d} for n, s, d in rows]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    save()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for wanted, module in ((args.memory or args.all, "gpu_memory"),
                           (args.rates or args.all, "gpu_rates")):
        if not wanted:
            continue
        t0 = time.perf_counter()
        try:
            rows += __import__(module).run(results)
        except Exception as exc:  # noqa: BLE001 - a section that raised is a FAIL row
            traceback.print_exc()
            rows.append((module, "FAIL", f"{type(exc).__name__}: {exc}"))
        print(f"[INFO] {module}: {time.perf_counter() - t0:.0f} s", flush=True)
        save()
    results["environment"]["nvidia_smi_after"] = environment().get("nvidia_smi")
    save()
    if args.json:
        print(f"[INFO] wrote {args.json}", flush=True)
    print(textwrap.dedent(f"""
        summary ({time.perf_counter() - started:.0f} s):"""))
    for name, status, detail in rows:
        first = detail.splitlines()[0] if detail else ""
        print(f"  {status:4}  {name}" + (f": {first[:160]}" if status != "PASS" or
                                          not name[0].isdigit() else ""))
    return 1 if any(status == "FAIL" for _, status, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
