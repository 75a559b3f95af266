"""The measured flash-attention rates the cost model prices Hopper runs with, derived from a
`benchmarks/gpu_layer.py` run (issue 35): writes tplab/cost/data/kernels/attention_hopper.json.

For each kernel (torch's FlashAttention-2 backend, "fa2"; cuDNN's fused attention,
"cudnn"), causal, bf16, head width 128, over micro-batch b x heads h x sequence s: the
forward and backward rates as fractions of the GPU's dense bf16 peak, at the model's FLOP
counts (forward 2 b s^2 h_dim, backward `kernels.FLASH_BACKWARD` times that), by sequence
and b h (the kernels' grid: one CTA per 128 query rows of one head, each CTA's work
growing with s): at each (s, b h) the median over the shapes with that product.

    python benchmarks/attention_table.py [RESULTS_JSON] [--check]

--check exits 1 when the stored table differs from the one derived now.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu-layer-2026-12-04.json"
TABLE = ROOT / "tplab" / "cost" / "data" / "kernels" / "attention_hopper.json"
PEAK = 989e12        # H200 SXM (and H100 SXM) dense bf16, the presets' `flops`
NAMES = {"flash": "fa2", "cudnn": "cudnn"}


def derive(results: dict) -> dict:
    from tplab.cost.kernels import FLASH_BACKWARD

    kernels = {}
    for backend, name in NAMES.items():
        cells: dict[int, dict[int, list[tuple[float, float]]]] = {}
        for r in results["attention"]:
            if r["backend"] != backend or "error" in r:
                continue
            b, h, s = r["batch"], r["heads"], r["seq"]
            flops = 2 * b * s * s * h * 128
            cells.setdefault(s, {}).setdefault(b * h, []).append(
                (flops / (r["fwd_ms"] * 1e-3) / PEAK,
                 FLASH_BACKWARD * flops / (r["bwd_ms"] * 1e-3) / PEAK))
        by_seq = {}
        for s in sorted(cells):
            bhs = sorted(cells[s])
            by_seq[str(s)] = {
                "batch_heads": bhs,
                "forward": [round(statistics.median(f for f, _ in cells[s][x]), 4) for x in bhs],
                "backward": [round(statistics.median(b for _, b in cells[s][x]), 4)
                             for x in bhs]}
        kernels[name] = {"seqs": sorted(cells), "by_seq": by_seq}
    env = results["environment"]
    return {"what": "flash attention's forward and backward rates / dense bf16 peak, causal, "
                    "bf16, head width 128, by sequence and micro-batch x heads (the median "
                    "over the measured shapes with that product)",
            "measured": f"one {env.get('gpu')}, torch {env['torch']} (CUDA {env['cuda']}, "
                        f"cuDNN {env['cudnn']}), CUDA events, a cool card (burst clocks), "
                        "2026-12-04",
            "results": str(RESULTS.relative_to(ROOT)),
            "peak_flops": PEAK,
            "kernels": kernels}


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--check"]
    results = json.loads(pathlib.Path(args[0] if args else RESULTS).read_text())
    table = derive(results)
    if "--check" in sys.argv:
        same = json.loads(TABLE.read_text()) == table
        print("attention table", "matches" if same else "differs from", RESULTS.name)
        return 0 if same else 1
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    for name, k in table["kernels"].items():
        for seq, cell in k["by_seq"].items():
            print(name, seq, " ".join(f"{x}:{f:.2f}/{b:.2f}" for x, f, b in zip(
                cell["batch_heads"], cell["forward"], cell["backward"], strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
