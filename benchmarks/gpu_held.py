"""Does a training step's mix settle at the power cap as back-to-back GEMMs do? (issue 35)

The Hopper presets' `sustained` clock is what one H200 held over 8 s of back-to-back 8192^3
GEMMs at its 700 W cap (0.84 of its burst rate). A second reader objected that a training
step is not back-to-back GEMMs: attention, element-wise work and the optimizer draw less
power, so the clocks during its GEMMs may sit higher. This measures it on the GPU in this
process: four of Llama-3 8B's layers as torchtitan runs them (eager, torch's default
attention, micro-batch 1 at 8192 tokens), forward and backward back to back, first on a cool
card (burst: the median of a few steps) and then held for SECONDS, timed in 16 windows
with nvidia-smi's SM clock and power sampled meanwhile; then the 8192^3 GEMM loop again on
the same, now warm, card (benchmarks/gpu_rates.gemm_held), beside its burst on the cool card
first (gemm_burst). The held / burst ratio of the
layers is the clock factor a training mix sees on this card, beside the GEMM loop's.

    PYTHONPATH=. python benchmarks/gpu_held.py --json PATH [--seconds 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from gpu_llama_block import Block
from gpu_rates import _smi_sampler, gemm_burst, gemm_held


def smi_samples(smi) -> list[list[float]]:
    samples = []
    if smi is not None:
        smi.terminate()
        for line in smi.communicate(timeout=10)[0].splitlines():
            try:
                samples.append([float(v) for v in line.split(",")])
            except ValueError:
                continue
    return samples


def held_layers(out: dict, seconds: float, device: str = "cuda") -> None:
    import torch

    from tplab import cost

    shape = cost.MODELS["Llama-3 8B"]
    seq, layers = 8192 if device == "cuda" else 256, 4
    hidden = shape.hidden if device == "cuda" else 256
    heads, kv = (shape.heads, shape.kv_heads) if device == "cuda" else (2, 1)
    ffn = shape.ffn_size if device == "cuda" else 512
    blocks = [Block(hidden, heads, kv, ffn, seq, 1, device) for _ in range(layers)]
    x = torch.randn(1, seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.ones_like(x)

    def step():
        h = x
        for b in blocks:
            h = b(h)
        h.backward(grad)

    def timed(calls: int) -> float:
        if device != "cuda":
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            return (time.perf_counter() - t0) * 1e3 / calls
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            step()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / calls

    for _ in range(3):
        step()
    burst = statistics.median(timed(1) for _ in range(5))      # the cool card
    calls = max(1, int(seconds / 16 / (burst * 1e-3)))
    smi = _smi_sampler() if device == "cuda" else None
    windows = [timed(calls) for _ in range(16)]
    out["held_layers"] = {
        "model": "Llama-3 8B", "layers": layers, "seq": seq, "micro_batch": 1,
        "seconds": seconds, "burst_ms": burst, "window_ms": windows,
        "last_half_ms": statistics.mean(windows[8:]),
        "burst_over_held": burst / statistics.mean(windows[8:]),
        "smi_clock_power_temp": smi_samples(smi)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--seconds", type=float, default=24.0)
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU")
    args = parser.parse_args()
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("SKIP: no CUDA GPU visible to torch")
        return 0
    out = {"what": __doc__.splitlines()[0], "torch": torch.__version__}
    if not args.cpu_smoke:
        gemm_burst(out)            # 8192^3 on the cool card, as gpu_rates.py first measures
    held_layers(out, 0.5 if args.cpu_smoke else args.seconds,
                "cpu" if args.cpu_smoke else "cuda")
    if not args.cpu_smoke:
        gemm_held(out, "gemm_held_after", 8192, 8192, 8192, 8.0)
        g, b = out["gemm_held_after"], out["gemm_burst"]
        out["gemm_held_over_burst"] = g["last_half_tflops"] / b["tflops"]
        print(f"GEMM 8192^3: burst {b['tflops']:.0f}, held after the layers "
              f"{g['last_half_tflops']:.0f} TFLOP/s (held / burst "
              f"{out['gemm_held_over_burst']:.3f})")
    h = out["held_layers"]
    print(f"4 layers of Llama-3 8B: burst {h['burst_ms']:.2f} ms, held {h['last_half_ms']:.2f} "
          f"ms (burst / held {h['burst_over_held']:.3f}); windows "
          + " ".join(f"{w:.1f}" for w in h["window_ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
