"""The cost model against published end-to-end training runs (docs/VALIDATION.md).

    TPLAB_VENV=... PYTHONPATH=$PWD scripts/env.sh python benchmarks/published_runs.py
    ... benchmarks/published_runs.py --markdown      # the table docs/VALIDATION.md holds

Prints each run of `tplab.cost.published.RUNS` (its source, what the source prints, the
tokens/s/GPU that follows), the model's prediction and its error, then the median and the
worst |error|. No GPU is needed: the runs were measured by their authors.
"""

import sys

from tplab.cost import published


def markdown(out: dict) -> str:
    lines = ["| # | source | run | TP | PP | VPP | CP | DP | mb | GBS | seq | precision | "
             "recompute | sharding | printed | measured | model | error | fits |",
             "|" + "---|" * 19]
    for i, r in enumerate(out["rows"], 1):
        dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
        lines.append(
            f"| {i} | {r['source']} | {r['where']} ({r['model']}, {r['gpus']} x "
            f"{r['hardware']}) | {r['tp']} | {r['pp']} | {r['vpp']} | {r['cp']} | {dp} | "
            f"{r['micro_batch']} | {r['global_batch']} | {r['seq_len']} | {r['precision']} | "
            f"{r['recompute']} | {r['sharding']} | {r['printed']} | {r['measured']:.0f} | "
            f"{r['predicted']:.0f} | {r['error']:+.0%} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    out = published.compare()
    if "--markdown" in sys.argv[1:]:
        print(markdown(out))
        return
    print(f"{'run':58s} {'printed':>26s} {'measured':>9s} {'model':>9s} {'error':>7s} "
          f"{'MFU':>5s}")
    for r in out["rows"]:
        print(f"{(r['source'].split(' ')[0] + ': ' + r['where'])[:58]:58s} "
              f"{r['printed']:>26s} {r['measured']:9.0f} {r['predicted']:9.0f} "
              f"{r['error']:+7.0%} {r['mfu']:5.2f}{'  (out of goal)' if r['excluded'] else ''}")
    print(f"{len(out['rows'])} runs; median |error| {out['median_all']:.0%}, worst "
          f"{out['worst_all']:+.0%} ({out['worst_all_row']['where']})")
    print(f"goal set ({out['goal_rows']} runs, without those marked 'out of the goal set'): "
          f"median |error| {out['median']:.0%}, worst {out['worst']:+.0%} "
          f"({out['worst_row']['where']}); goal: median <= 10%, worst <= 25%")


if __name__ == "__main__":
    main()
