"""One Llama layer on one GPU, its parts timed against the cost model's parts (issue 35).

The published runs the cost model is scored on (docs/VALIDATION.md) ran on H100s and A100s
that this project cannot reach; an H200 sometimes can be. This measures, on the GPU in this
process, what the model prices per layer, each part on its own and then together:

- attention: torch's scaled_dot_product_attention, causal, bf16, head width 128, forward and
  backward, by backend (FlashAttention-2 in torch's "flash" backend, what torchtitan's SDPA
  runs; cuDNN's fused attention, the kernel class Transformer Engine runs on Hopper), over
  micro-batch x heads per rank x sequence: against `kernels.attention_time` +
  `attention_backward` (`Hardware.attention_efficiency`, one rate for every shape);
- the linears of a layer (forward, input gradient, weight gradient as autograd runs them)
  against 3 x `kernels.linear_time`;
- eager element-wise work as torchtitan's Llama runs it (RMSNorm in fp32, RoPE through
  complex numbers, repeat_kv, SiLU x gate, residual adds) against
  `kernels.elementwise_bytes(..., "eager")` at `achievable_bandwidth`;
- each linear's GEMM in bf16 and in fp8 (tensorwise-scaled e4m3, `torch._scaled_mm`) at
  the Llama-3 70B / 405B layouts' shapes, against `gemm_time` in each precision;
- each eager element-wise op alone against its bytes in that count;
- the whole layer, eager and under torch.compile (with torch's default attention and with
  FlashAttention-2 held), forward + backward, against
  `training_run.layer_times` for the "torchtitan" / "torchtitan+compile" stacks.

Each model figure is given at the preset's sustained clock (what `predict` uses) and at
the burst clock (`sustained` = 1): a run of milliseconds on a cool card sits between them.
Nothing in tplab.cost changes here; the numbers go to --json.

    PYTHONPATH=. python benchmarks/gpu_layer.py --json out.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

from gpu_llama_block import Block, attention_only, linears_only

PRESET = "H200 SXM"
HEAD_DIM = 128
DEVICE = "cuda"   # --cpu-smoke sets "cpu": the code path checked where no GPU is
GRID = {"quick": ((1, 2), (8, 32), (4096, 8192)),       # (micro-batches, heads, sequences)
        "full": ((1, 2, 4), (2, 4, 8, 16, 32, 64), (2048, 4096, 8192, 16384, 32768))}
SEQ = 8192
CASES = [("Llama-3 8B", 1, 1), ("Llama-3 8B", 2, 1), ("Llama-3 70B", 1, 8),
         ("Llama-3 8B", 1, 2), ("Llama-3 70B", 2, 8), ("Llama-3 70B", 1, 4)]
"""(model, micro-batch, TP): torchtitan's Table 1/3 runs (8B, micro-batch 2, 8192 tokens)
and one TP rank's share of 70B; a TP rank here computes alone (no collectives)."""


def smoke() -> None:
    """Toy sizes for --cpu-smoke: every code path once, on the CPU."""
    global SEQ, CASES, GRID
    from tplab import cost

    tiny = cost.BlockShape(hidden=256, heads=2, kv_heads=1, ffn=512, gated=True, layers=2,
                           vocab=1024, name="tiny")
    GRID = {"quick": ((1,), (2,), (256,)), "full": ((1,), (2,), (256,))}
    SEQ, CASES = 256, [(tiny, 2, 1), (tiny, 1, 2)]


def time_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` over `reps` calls (CUDA events, after `warmup`)."""
    import torch

    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":     # the CPU smoke run: wall clock, one call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def fwd_bwd_ms(make, reps: int = 10) -> tuple[float, float]:
    """(forward ms, backward ms) of the autograd graph `make()` returns: a tensor or a list
    of them, each given a gradient of ones."""
    import torch

    def outs():
        o = make()
        return o if isinstance(o, (list, tuple)) else [o]

    grads = [torch.ones_like(o) for o in outs()]
    fwd = time_ms(outs, reps)
    total = time_ms(lambda: torch.autograd.backward(outs(), grads), reps)
    return fwd, max(0.0, total - fwd)


def model_hw(burst: bool):
    from tplab import cost

    hw = cost.HARDWARE[PRESET]
    return hw.with_(sustained=1.0) if burst else hw


def attention_grid(out: dict, quick: bool) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tplab import cost
    from tplab.cost import kernels

    backends = {"flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    batches, heads_all, seqs = GRID["quick" if quick else "full"]
    rows = []
    for name, backend in backends.items():
        for b in batches:
            for h in heads_all:
                for s in seqs:
                    if b * h * s > 2 * 64 * 16384:     # keep each case under ~1 GiB a tensor
                        continue
                    row = {"backend": name, "batch": b, "heads": h, "seq": s}
                    try:
                        q, k, v = (torch.randn(b, h, s, HEAD_DIM, device=DEVICE,
                                               dtype=torch.bfloat16, requires_grad=True)
                                   for _ in range(3))

                        def run(q=q, k=k, v=v, backend=backend):
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        fwd, bwd = fwd_bwd_ms(run, reps=6)
                        shape = cost.BlockShape(hidden=h * HEAD_DIM, heads=h, seq=s, batch=b,
                                                ffn=4 * h * HEAD_DIM)
                        flops = 2 * b * s * s * h * HEAD_DIM     # the model's causal count
                        row.update(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9,
                                   fwd_of_peak=flops / fwd / 1e9 / (model_hw(True).flops / 1e12))
                        for burst in (False, True):
                            hw = model_hw(burst)
                            pf = kernels.attention_time(shape, 1, 1, hw) * 1e3
                            pb = kernels.attention_backward(shape, 1, 1, hw) * 1e3
                            key = "burst" if burst else "sustained"
                            row[f"model_{key}_fwd_bwd_ms"] = pf + pb
                            row[f"measured_over_model_{key}"] = (fwd + bwd) / (pf + pb)
                        del q, k, v
                    except Exception as e:   # a backend that refuses a shape: recorded
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
                    if DEVICE == "cuda":
                        torch.cuda.empty_cache()
    out["attention"] = rows


def layer(out: dict, quick: bool) -> None:
    import torch

    rows = []
    for model, mb, tp in CASES[: 3 if quick else None]:
        row = {"model": getattr(model, "name", model), "micro_batch": mb, "tp": tp,
               "seq": SEQ}
        try:
            layer_case(row, model, mb, tp)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        rows.append(row)
        torch._dynamo.reset()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out["layer"] = rows


def measured_parts(row: dict, blk: Block, x, mb: int, tp: int) -> dict:
    """Each part's (forward ms, backward ms) on the GPU."""
    import torch

    seq = blk.seq
    leaves = blk.leaves(mb)
    parts = {"eager": fwd_bwd_ms(lambda: blk(x)),
             "linears": fwd_bwd_ms(lambda: linears_only(blk, x, leaves)),
             "attention": fwd_bwd_ms(lambda: attention_only(blk, mb, seq)),
             "elementwise": fwd_bwd_ms(lambda: blk.elementwise(x, leaves))}
    try:
        parts["attention_cudnn"] = fwd_bwd_ms(lambda: attention_only(blk, mb, seq, "cudnn"))
    except RuntimeError as e:       # no cuDNN attention for this shape or device
        row["attention_cudnn_error"] = str(e)[:200]
    parts["eager_fa2"] = fwd_bwd_ms(lambda: with_backend("flash", blk, x))
    if tp == 1 and mb == 2:    # torchtitan's Tables 1 and 3: micro-batch 2, TP 1
        flash = torch.compile(blk.__call__)
        with_backend("flash", flash, x).backward(torch.ones_like(x))
        parts["compiled_fa2"] = fwd_bwd_ms(lambda: with_backend("flash", flash, x))
        torch._dynamo.reset()
    if tp == 1:    # torchtitan's compiled runs are TP 1 (Tables 1 and 3)
        compiled = torch.compile(blk.__call__)
        t0 = time.time()
        compiled(x).backward(torch.ones_like(x))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        row["compile_s"] = time.time() - t0
        parts["compiled"] = fwd_bwd_ms(lambda: compiled(x))
    return parts


def with_backend(name: str, fn, x):
    """`fn(x)` with SDPA held to one backend ("flash": FlashAttention-2; "cudnn")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    with sdpa_kernel(backend):
        return fn(x)


def eager_ops(out: dict, quick: bool) -> None:
    """Each eager element-wise op of torchtitan's Llama block (and MPT's LayerNorm and GELU)
    alone, forward and backward, at Llama-3 8B's shapes (micro-batch 1, 8192 tokens), with
    the bytes `kernels.elementwise_bytes` counts for it (forward; backward twice that)."""
    import torch
    import torch.nn.functional as F

    from tplab import cost

    hw = cost.HARDWARE[PRESET]
    shape = cost.MODELS["Llama-3 8B"]
    h, f, seq = shape.hidden, shape.ffn_size, SEQ
    blk = Block(h, shape.heads, shape.kv_heads, f, seq, 1, DEVICE)
    tokens = seq
    q, k, _, o, a, g1, g3 = blk.leaves(1)
    x = torch.randn(1, seq, h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    kv = shape.kv_dim
    ops = {   # name: (call, the model's forward bytes per token for it)
        "rmsnorm (fp32)": (lambda: blk.rms(x, blk.n1), 36 * h),
        "rope q (complex)": (lambda: blk.rope(q), 20 * h),
        "rope k (complex)": (lambda: blk.rope(k), 20 * kv),
        "transpose copy": (lambda: o.transpose(1, 2).contiguous(), 4 * h),
        "residual add": (lambda: x + a, 6 * h),
        "silu x gate": (lambda: F.silu(g1) * g3, 10 * f),
        "repeat_kv (k)": (lambda: k[:, :, :, None, :].expand(
            1, seq, shape.kv_heads, shape.heads // shape.kv_heads, HEAD_DIM).reshape(
            1, seq, shape.heads, HEAD_DIM), 0),
        "layernorm (bf16, MPT)": (lambda: F.layer_norm(x, (h,), w), 4 * h),
        "gelu (MPT, 4h)": (lambda: F.gelu(g1), 4 * f)}
    rows = []
    for name, (call, per_token) in ops.items():
        fwd, bwd = fwd_bwd_ms(call, reps=10)
        model = per_token * tokens / hw.achievable_bandwidth * 1e3
        rows.append({"op": name, "fwd_ms": fwd, "bwd_ms": bwd, "model_fwd_ms": model,
                     "model_bwd_ms": 2 * model,
                     "fwd_over_model": fwd / model if model else None,
                     "bwd_over_model": bwd / (2 * model) if model else None})
    out["eager_ops"] = rows


def model_parts(shape, mb: int, tp: int, burst: bool) -> dict:
    """The cost model's milliseconds for the same parts (forward + backward)."""
    from tplab import cost
    from tplab.cost import kernels
    from tplab.cost.training_run import layer_times

    hw = model_hw(burst)
    tokens = mb * shape.seq
    whole = {}
    for stack in ("torchtitan", "torchtitan+compile"):
        run = cost.TrainingRun(shape, hw, tp, tp=tp, micro_batch=mb, seq_len=shape.seq,
                               stack=stack)
        lt = layer_times(run)
        whole[stack] = (lt.forward_s + lt.backward_s) * 1e3
    return {"linears": 3 * kernels.linear_time(shape, tokens, tp, hw) * 1e3,
            "attention": (kernels.attention_time(shape, 1, tp, hw)
                          + kernels.attention_backward(shape, 1, tp, hw)) * 1e3,
            "elementwise": 3 * kernels.elementwise_bytes(shape, tokens, tp, "eager")
            / hw.achievable_bandwidth * 1e3, **whole}


def layer_case(row: dict, model, mb: int, tp: int) -> None:
    import torch

    from tplab import cost

    shape = (cost.MODELS[model] if isinstance(model, str) else model).with_(seq=SEQ, batch=mb)
    blk = Block(shape.hidden, shape.heads, shape.kv_heads or shape.heads, shape.ffn_size,
                SEQ, tp, DEVICE)
    x = torch.randn(mb, SEQ, shape.hidden, device=DEVICE, dtype=torch.bfloat16,
                    requires_grad=True)
    parts = measured_parts(row, blk, x, mb, tp)
    m = row["measured_ms"] = {k: {"fwd": f, "bwd": b, "total": f + b}
                              for k, (f, b) in parts.items()}
    row["model_sustained_ms"] = s = model_parts(shape, mb, tp, burst=False)
    row["model_burst_ms"] = model_parts(shape, mb, tp, burst=True)
    ratio = {"linears": m["linears"]["total"] / s["linears"],
             "attention": m["attention"]["total"] / s["attention"],
             "elementwise": m["elementwise"]["total"] / s["elementwise"],
             "eager layer": m["eager"]["total"] / s["torchtitan"]}
    if "attention_cudnn" in m:
        ratio["attention (cuDNN)"] = m["attention_cudnn"]["total"] / s["attention"]
    if "compiled" in m:
        ratio["compiled layer"] = m["compiled"]["total"] / s["torchtitan+compile"]
    ratio["eager layer, FA2"] = m["eager_fa2"]["total"] / s["torchtitan"]
    if "compiled_fa2" in m:
        ratio["compiled layer, FA2"] = m["compiled_fa2"]["total"] / s["torchtitan+compile"]
    row["measured_over_model_sustained"] = ratio


def fp8_gemms(out: dict, quick: bool) -> None:
    """Each linear of a layer (`kernels.linear_gemms`: Llama-3 70B and 405B, 8192 tokens,
    TP 1/4/8, the dgxc layouts' ranks) in bf16 (`F.linear`) and in fp8 e4m3 with tensorwise
    scales (`torch._scaled_mm`, bf16 out, fast accumulation on and off: Transformer
    Engine's forward GEMM and its dgrad/wgrad), against `gemm_time(..., sustained=False)`
    in each precision."""
    import torch
    import torch.nn.functional as F

    from tplab import cost
    from tplab.cost.kernels import gemm_time, linear_gemms

    hw = cost.HARDWARE[PRESET]
    rows = []
    cases = [("Llama-3 70B", 8)] if quick else [
        ("Llama-3 70B", 1), ("Llama-3 70B", 4), ("Llama-3 70B", 8), ("Llama-3.1 405B", 8)]
    one = torch.ones((), device=DEVICE, dtype=torch.float32)
    for model, tp in cases:
        for m, n, k in linear_gemms(cost.MODELS[model], 8192 if DEVICE == "cuda" else 64, tp):
            if DEVICE != "cuda":
                m, n, k = 64, 32, 48
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
            row = {"model": model, "tp": tp, "m": m, "n": n, "k": k,
                   "bf16_ms": time_ms(lambda x=x, w=w: F.linear(x, w), 20),
                   "model_bf16_ms": gemm_time(m, n, k, hw, sustained=False) * 1e3,
                   "model_fp8_ms": gemm_time(m, n, k, hw, "fp8", sustained=False) * 1e3}
            try:
                a = x.to(torch.float8_e4m3fn)
                b = w.to(torch.float8_e4m3fn).t()      # column-major (k, n)
                for fast in (True, False):
                    row[f"fp8_ms_fast_accum_{fast}"] = time_ms(
                        lambda a=a, b=b, fast=fast: torch._scaled_mm(
                            a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast), 20)
                row["fp8_tflops_fast"] = 2 * m * n * k / row["fp8_ms_fast_accum_True"] / 1e9
                row["fp8_measured_over_model"] = (row["fp8_ms_fast_accum_True"]
                                                  / row["model_fp8_ms"])
            except Exception as e:      # no fp8 GEMM on this device or build
                row["fp8_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["bf16_measured_over_model"] = row["bf16_ms"] / row["model_bf16_ms"]
            rows.append(row)
    out["fp8_gemms"] = rows


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the code path on the CPU at toy sizes (no timing meaning)")
    parser.add_argument("--only", metavar="NAMES", default="fp8_gemms,attention,layer,eager_ops",
                        help="comma-separated sections to run")
    args = parser.parse_args()
    import torch

    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
        smoke()
    elif not torch.cuda.is_available():
        print("SKIP: no CUDA GPU visible to torch")
        return 0
    out = {"what": __doc__.splitlines()[0], "environment": environment(), "preset": PRESET}
    sections = {"fp8_gemms": fp8_gemms, "attention": attention_grid, "layer": layer,
                "eager_ops": eager_ops}
    wanted = args.only.split(",")
    if not set(wanted) <= set(sections):
        parser.error(f"--only {args.only!r}: sections are {', '.join(sections)}")
    for name, fn in ((n, sections[n]) for n in wanted):
        t0 = time.time()
        try:
            fn(out, args.quick)
        except Exception as e:
            out[name + "_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"[gpu_layer] {name}: {time.time() - t0:.1f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
    for r in out.get("layer", []):
        print(json.dumps({k: r.get(k) for k in ("model", "micro_batch", "tp",
                                                 "measured_over_model_sustained", "error")}))
    for r in out.get("eager_ops", []):
        print(f"{r['op']:24s} fwd {r['fwd_ms']:.3f} ms bwd {r['bwd_ms']:.3f} ms; x model "
              f"{r['fwd_over_model'] or 0:.2f} / {r['bwd_over_model'] or 0:.2f}")
    for r in out.get("fp8_gemms", []):
        print(f"{r['model']} tp{r['tp']} {r['m']}x{r['n']}x{r['k']}: bf16 x model "
              f"{r['bf16_measured_over_model']:.2f}, fp8 x model "
              f"{r.get('fp8_measured_over_model', float('nan')):.2f}")
    for r in out.get("attention", []):
        if "error" in r:
            continue
        print(f"{r['backend']:5} b{r['batch']} h{r['heads']:2} s{r['seq']:5} "
              f"fwd {r['fwd_tflops']:6.1f} TF/s  x model {r['measured_over_model_sustained']:.2f}")
    bad = [r for r in out.get("layer", []) if "error" in r]
    return 1 if bad or any(k.endswith("_error") for k in out) else 0


if __name__ == "__main__":
    sys.exit(main())
