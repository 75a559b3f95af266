"""The cost model against published end-to-end training runs (docs/VALIDATION.md).

    TPLAB_VENV=... PYTHONPATH=$PWD scripts/env.sh python benchmarks/published_runs.py

Prints each run of `tplab.cost.published.RUNS` (its source, what the source prints, the
tokens/s/GPU that follows), the model's prediction and its error, then the median and the
worst |error|. No GPU is needed: the runs were measured by their authors.
"""

from tplab.cost import published


def main() -> None:
    out = published.compare()
    print(f"{'run':58s} {'printed':>22s} {'measured':>9s} {'model':>9s} {'error':>7s} "
          f"{'MFU':>5s}")
    for r in out["rows"]:
        print(f"{(r['source'].split(' ')[0] + ': ' + r['where'])[:58]:58s} "
              f"{r['printed']:>22s} {r['measured']:9.0f} {r['predicted']:9.0f} "
              f"{r['error']:+7.0%} {r['mfu']:5.2f}")
    print(f"{len(out['rows'])} runs; median |error| {out['median']:.0%}, worst "
          f"{out['worst']:+.0%} ({out['worst_row']['where']}); goal: median <= 10%, "
          "worst <= 25%")


if __name__ == "__main__":
    main()
