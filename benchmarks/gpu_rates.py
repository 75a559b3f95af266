"""The H200 preset's kernel rates, measured on the GPU in this process (benchmarks/gpu.py
--rates runs this; the GPU path of issue 39, item 3).

- bf16 GEMM, mamf-finder's way: a sweep of (m, n, k) over 2048..16384, each the median of
  its timed calls (CUDA events, after warm-up, random data), and the maximum over the sweep
  (MAMF), against `matmul_efficiency` x `flops`; 8192^3 first of all, while the card is
  cool, as KINDS.md's reading was taken; the lesson's GEMMs (`tplab.cost.kernels.
  linear_gemms` of Llama-3 8B and 70B at 4096 tokens, TP 1 and 8, as `F.linear`) against
  `gemm_time(..., sustained=False)`; and the rate held over several seconds of back-to-back
  GEMMs (8192^3 for 8 s, the lesson's 4096 x 28672 x 4096 for 4 s; the last half of each
  window, nvidia-smi's SM clock and power read meanwhile) against `sustained` x MAMF.
- scaled_dot_product_attention, flash backend only, causal, bf16, batch 1, head width 128,
  at notebook 08's sequence lengths (4096, and 8192 in its later sections) with 32 and 8
  heads (Llama-3 8B at TP 1, 70B at TP 8): forward and backward time, the forward's rate at
  the model's FLOPs (2 b s^2 h causal) against `attention_efficiency` x `flops`, and
  backward / forward against FLASH_BACKWARD.
- memory bandwidth: a 4 GiB device-to-device copy, bytes read + written, against
  `memory_bandwidth`.

A single GPU cannot measure NVLink or NCCL collectives between GPUs: the links' constants
are neither confirmed nor contradicted here. This script changes nothing in tplab.cost
(the copy's fraction is priced as `HBM_EFFICIENCY`: docs/VALIDATION.md, round thirteen).
"""

from __future__ import annotations

import statistics
import time
import traceback

PRESET = "H200 SXM"
SWEEP = (2048, 4096, 6144, 8192, 12288, 16384)


def _time_ms(fn, reps: int = 10, warmup: int = 3) -> list[float]:
    """Each call's milliseconds (CUDA events around each, after `warmup` calls)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def gemm_sweep(out: dict) -> None:
    import torch

    rows = []
    for m in SWEEP:
        for n in SWEEP:
            for k in SWEEP:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                ms = statistics.median(_time_ms(lambda a=a, b=b: torch.mm(a, b), reps=8))
                rows.append({"m": m, "n": n, "k": k, "ms": ms,
                             "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12})
                del a, b
    best = max(rows, key=lambda r: r["tflops"])
    out["gemm_sweep"] = {"rows": rows, "max": best}


def gemm_lesson(out: dict) -> None:
    import torch
    import torch.nn.functional as F

    from tplab import cost
    from tplab.cost.kernels import gemm_time, linear_gemms

    hw = cost.HARDWARE[PRESET]
    rows = []
    for model in ("Llama-3 8B", "Llama-3 70B"):
        shape = cost.MODELS[model]
        for tp in (1, 8):
            for m, n, k in linear_gemms(shape, 4096, tp):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                ms = statistics.median(_time_ms(lambda x=x, w=w: F.linear(x, w), reps=20))
                pred = gemm_time(m, n, k, hw, sustained=False) * 1e3
                rows.append({"model": model, "tp": tp, "m": m, "n": n, "k": k, "ms": ms,
                             "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12,
                             "predicted_ms": pred, "measured_over_predicted": ms / pred})
                del x, w
    out["gemm_lesson"] = rows


def gemm_burst(out: dict, n: int = 8192) -> None:
    """n^3 as KINDS.md measured it on such a machine: 3 warm-ups, the median of 10, run
    first (the card cool, near idle)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: torch.mm(a, b), reps=10)
    out["gemm_burst"] = {"n": n, "ms": ms, "tflops": 2 * n**3 / (statistics.median(ms)
                                                                   * 1e-3) / 1e12}


def _smi_sampler():
    """nvidia-smi read every 250 ms (SM clock MHz, power W, temperature C), or None."""
    import subprocess

    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,"
                                 "temperature.gpu", "--format=csv,noheader,nounits",
                                 "-lms", "250"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    except OSError:
        return None


def gemm_held(out: dict, key: str, m: int, n: int, k: int, seconds: float) -> None:
    """Back-to-back (m x k) @ (k x n) GEMMs for `seconds`; the rate in each of 16 windows,
    the mean over the last half, and nvidia-smi's clock and power meanwhile."""
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    per = statistics.median(_time_ms(lambda: torch.mm(a, b), reps=5)) * 1e-3
    calls = max(1, int(seconds / 16 / per))
    smi = _smi_sampler()
    windows = []
    for _ in range(16):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            torch.mm(a, b)
        e.record()
        windows.append((s, e))
    torch.cuda.synchronize()
    samples = []
    if smi is not None:
        smi.terminate()
        text = smi.communicate(timeout=10)[0]
        for line in text.splitlines():
            try:
                samples.append([float(v) for v in line.split(",")])
            except ValueError:
                continue
    rates = [calls * 2 * m * n * k / (s.elapsed_time(e) * 1e-3) / 1e12 for s, e in windows]
    out[key] = {"m": m, "n": n, "k": k, "seconds": seconds, "window_tflops": rates,
                "last_half_tflops": statistics.mean(rates[8:]),
                "smi_clock_power_temp": samples}


def attention(out: dict) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tplab.cost.kernels import FLASH_BACKWARD

    rows = []
    for seq in (4096, 8192):
        for heads in (32, 8):
            q, k, v = (torch.randn(1, heads, seq, 128, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                fwd = statistics.median(_time_ms(
                    lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v,
                                                                         is_causal=True)))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                g = torch.randn_like(o)
                bwd = statistics.median(_time_ms(
                    lambda o=o, g=g, q=q, k=k, v=v: torch.autograd.grad(
                        o, (q, k, v), g, retain_graph=True)))
            flops = 2 * seq * seq * heads * 128          # causal forward, tplab.cost's count
            rows.append({"seq": seq, "heads": heads, "head_dim": 128, "fwd_ms": fwd,
                         "bwd_ms": bwd, "fwd_tflops": flops / (fwd * 1e-3) / 1e12,
                         "bwd_tflops_at_model_flops": FLASH_BACKWARD * flops / (bwd * 1e-3)
                         / 1e12, "bwd_over_fwd": bwd / fwd})
            del q, k, v, o, g
    out["attention"] = rows


def bandwidth(out: dict, gib: int = 4) -> None:
    import torch

    src = torch.randint(0, 255, (gib * 2**30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(_time_ms(lambda: dst.copy_(src), reps=20))
    out["bandwidth"] = {"bytes": 2 * src.numel(), "ms": ms,
                        "tb_s": 2 * src.numel() / (ms * 1e-3) / 1e12}


def run(results: dict) -> list[tuple[str, str, str]]:
    """Every measurement, each on its own (a failure is a FAIL row and the next runs);
    fills results["rates"] and returns summary rows (name, status, detail)."""
    import torch

    from tplab import cost
    from tplab.cost.kernels import FLASH_BACKWARD

    hw = cost.HARDWARE[PRESET]
    mamf = hw.flops * hw.matmul_efficiency
    out = results.setdefault("rates", {"errors": []})
    out["preset"] = {"name": PRESET, "flops": hw.flops, "matmul_efficiency":
                     hw.matmul_efficiency, "mamf": mamf, "sustained": hw.sustained,
                     "attention_efficiency": hw.attention_efficiency,
                     "flash_backward": FLASH_BACKWARD, "memory_bandwidth":
                     hw.memory_bandwidth, "memory": hw.memory, "sms": hw.sms}
    out["device_total_memory"] = torch.cuda.get_device_properties(0).total_memory
    out["device_sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [("device memory (bytes)", "INFO", f"{out['device_total_memory']} vs preset "
             f"{hw.memory:.0f} ({out['device_total_memory'] / hw.memory:.4f}); SMs "
             f"{out['device_sms']} vs {hw.sms}")]
    for name, fn in (("gemm burst", gemm_burst), ("bandwidth", bandwidth),
                     ("gemm sweep", gemm_sweep), ("gemm lesson", gemm_lesson),
                     ("gemm sustained", lambda o: gemm_held(o, "gemm_sustained", 8192, 8192,
                                                            8192, 8.0)),
                     ("gemm held, lesson shape", lambda o: gemm_held(
                         o, "gemm_held_lesson", 4096, 28672, 4096, 4.0)),
                     ("attention", attention)):
        started = time.perf_counter()
        try:
            fn(out)
        except Exception as exc:  # noqa: BLE001 - reported; the next measurement runs
            why = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            out["errors"].append({"what": name, "error": why,
                                  "traceback": traceback.format_exc(limit=-4)})
            print(f"[FAIL] rates: {name}: {why}", flush=True)
            rows.append((f"rates: {name}", "FAIL", why))
            continue
        finally:
            torch.cuda.empty_cache()
        print(f"[INFO] rates: {name} measured ({time.perf_counter() - started:.1f} s)",
              flush=True)
    rows += _report(out, hw, mamf)
    return rows


def _report(out: dict, hw, mamf: float) -> list[tuple[str, str, str]]:
    rows = []
    if "bandwidth" in out:
        b = out["bandwidth"]["tb_s"] * 1e12
        rows.append(("copy bandwidth (TB/s)", "INFO", f"{b / 1e12:.2f} vs memory_bandwidth "
                     f"{hw.memory_bandwidth / 1e12:.2f}: ratio {b / hw.memory_bandwidth:.3f}"))
    if "gemm_sweep" in out:
        best = out["gemm_sweep"]["max"]
        rows.append(("bf16 GEMM max over sweep (TFLOP/s)", "INFO",
                     f"{best['tflops']:.1f} at {best['m']}x{best['n']}x{best['k']} vs "
                     f"MAMF {mamf / 1e12:.1f}: ratio {best['tflops'] * 1e12 / mamf:.3f}"))
        print("[INFO] GEMM sweep, best 5: " + "; ".join(
            f"{r['m']}x{r['n']}x{r['k']} {r['tflops']:.0f}" for r in sorted(
                out["gemm_sweep"]["rows"], key=lambda r: -r["tflops"])[:5]), flush=True)
    if "gemm_lesson" in out:
        ratios = [r["measured_over_predicted"] for r in out["gemm_lesson"]]
        for r in out["gemm_lesson"]:
            print(f"[INFO] lesson GEMM {r['model']} TP {r['tp']} {r['m']}x{r['n']}x{r['k']}: "
                  f"{r['ms']:.3f} ms ({r['tflops']:.0f} TFLOP/s), gemm_time "
                  f"{r['predicted_ms']:.3f} ms, measured/predicted "
                  f"{r['measured_over_predicted']:.3f}", flush=True)
        rows.append(("lesson GEMMs: measured / gemm_time", "INFO",
                     f"median {statistics.median(ratios):.3f}, range {min(ratios):.3f}.."
                     f"{max(ratios):.3f} over {len(ratios)} GEMMs; rates "
                     f"{min(r['tflops'] for r in out['gemm_lesson']):.0f}.."
                     f"{max(r['tflops'] for r in out['gemm_lesson']):.0f} TFLOP/s"))
    if "gemm_burst" in out:
        b = out["gemm_burst"]["tflops"] * 1e12
        rows.append(("bf16 GEMM 8192^3 first, cool (TFLOP/s)", "INFO", f"{b / 1e12:.1f} vs "
                     f"MAMF {mamf / 1e12:.1f}: ratio {b / mamf:.3f}"))
    for key in ("gemm_sustained", "gemm_held_lesson"):
        if key not in out:
            continue
        s = out[key]
        held = s["last_half_tflops"] * 1e12
        smi = s["smi_clock_power_temp"]
        seen = (f"; SM clock {min(x[0] for x in smi):.0f}..{max(x[0] for x in smi):.0f} "
                f"MHz, power {min(x[1] for x in smi):.0f}..{max(x[1] for x in smi):.0f} W"
                if smi and all(len(x) == 3 for x in smi) else "")
        rows.append((f"bf16 GEMM held {s['seconds']:.0f} s, {s['m']}x{s['n']}x{s['k']}",
                     "INFO", f"{held / 1e12:.1f} TFLOP/s (windows "
                     f"{min(s['window_tflops']):.0f}..{max(s['window_tflops']):.0f}) vs "
                     f"sustained x MAMF {hw.sustained * mamf / 1e12:.1f}: ratio "
                     f"{held / (hw.sustained * mamf):.3f}{seen}"))
    if "attention" in out:
        peak = hw.flops * hw.attention_efficiency
        for r in out["attention"]:
            rows.append((f"flash SDPA s={r['seq']} h={r['heads']}", "INFO",
                         f"fwd {r['fwd_ms']:.3f} ms {r['fwd_tflops']:.0f} TFLOP/s vs "
                         f"attention_efficiency x flops {peak / 1e12:.0f}: ratio "
                         f"{r['fwd_tflops'] * 1e12 / peak:.2f}; bwd {r['bwd_ms']:.3f} ms, "
                         f"bwd/fwd {r['bwd_over_fwd']:.2f} vs FLASH_BACKWARD "
                         f"{out['preset']['flash_backward']}"))
    rows.append(("NVLink / NCCL collectives", "SKIP", "one GPU: nothing between GPUs to "
                 "measure; the links' constants are neither confirmed nor contradicted"))
    return rows
