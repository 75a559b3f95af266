"""The cost model against published end-to-end training runs (docs/VALIDATION.md).

    scripts/env.sh python benchmarks/published_runs.py
    scripts/env.sh python benchmarks/published_runs.py --markdown   # docs/VALIDATION.md's table

Prints each run of `tplab.cost.published.RUNS` (its source, stack, what the source prints,
the tokens/s/GPU that follows), the model's prediction and its error, then the goal figures
of `tplab.cost.scores` over all rows and over the goal set (both ways). No GPU is needed:
the runs were measured by their authors.
"""

import sys

from tplab.cost import published, scores


def markdown(out: dict) -> str:
    lines = ["| # | source | run | stack | TP | PP | VPP | CP | DP | mb | GBS | seq | "
             "precision | recompute | sharding | printed | measured | model | error | fits |",
             "|" + "---|" * 20]
    for i, r in enumerate(out["rows"], 1):
        dp = r["gpus"] // (r["tp"] * r["pp"] * r["cp"])
        lines.append(
            f"| {i} | {r['source']} | {r['where']} ({r['model']}, {r['gpus']} x "
            f"{r['hardware']}) | {r['stack']} | {r['tp']} | {r['pp']} | {r['vpp']} | "
            f"{r['cp']} | {dp} | {r['micro_batch']} | {r['global_batch']} | {r['seq_len']} | "
            f"{r['precision']} | {r['recompute']} | {r['sharding']} | {r['printed']} | "
            f"{r['measured']:.0f} | {r['predicted']:.0f} | {r['error']:+.0%} | "
            f"{'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def figures(s: dict, way: str) -> None:
    e = s[way]
    good, total = s[f"pairs_{way}"]
    print(f"\n== {way} rows ({e['rows']}): median |error| {e['median']:.1%} (goal <= 8%), "
          f"p90 {e['p90']:.1%} (goal <= 20%); pairs ordered {good}/{total} = "
          f"{good / total:.1%} (goal >= 95%)")
    for src, m in e["signed"].items():
        lo = s[f"loso_{way}"][src]
        print(f"  {src[:60]:60s} signed median {m:+6.1%} (goal +-8%); left out: "
              f"{lo['before']:5.1%} -> {lo['after']:5.1%} with factor {lo['factor']:.3f} "
              "fit on the rest (goal <= 12%)")


def main() -> None:
    out = published.compare()
    if "--markdown" in sys.argv[1:]:
        print(markdown(out))
        return
    print(f"{'run':58s} {'stack':18s} {'printed':>26s} {'measured':>9s} {'model':>9s} "
          f"{'error':>7s}")
    for r in out["rows"]:
        print(f"{(r['source'].split(' ')[0] + ': ' + r['where'])[:58]:58s} "
              f"{r['stack']:18s} {r['printed'][:26]:>26s} {r['measured']:9.0f} "
              f"{r['predicted']:9.0f} {r['error']:+7.0%}"
              f"{'  (out of goal)' if r['excluded'] else ''}")
    s = scores.score(out)
    reasons: dict[str, int] = {}
    for _, why in published.UNSCORED:
        key = why.split(":")[1].strip()
        reasons[key] = reasons.get(key, 0) + 1
    print(f"\n{len(published.ROWS)} rows read; {len(published.RUNS)} scored; "
          f"{len(published.UNSCORED)} not expressible by TrainingRun: "
          + ", ".join(f"{n} {why}" for why, n in reasons.items()))
    figures(s, "all")
    figures(s, "goal")
    k = s["korthikanti"]
    print(f"\nKorthikanti 2022's {k['runs']} runs: mean |error| {k['mean']:.2%} (goal <= "
          f"3.65%, Calculon's), max {k['max']:.2%}")
    m = s["memory"]
    print(f"memory vs {len(m['rows'])} printed peaks: {m['within_10']} within +-10% "
          f"(goal: all), worst {m['worst']:+.0%}")
    for r, e in zip(m["rows"], m["errors"], strict=True):
        print(f"  {r['where'][:70]:70s} peak {r['peak_gib']:5.1f} GiB, model "
              f"{r['reserved_gib']:5.1f} GiB reserved ({e:+.0%}; {r['memory_gib']:5.1f} GiB in "
              f"all), fits {'yes' if r['fits'] else 'no'}")
    print(f"published runs the model says do not fit: {len(m['not_fitting'])} (goal: 0)")
    for r in m["not_fitting"]:
        print(f"  {r['source'][:40]}: {r['where'][:60]} ({r['memory_gib']:.1f} GiB)")
    print("rows whose unprinted settings decide the fit (published.fitting: the fastest "
          "that fits):")
    for r in out["rows"]:
        if r["fit_setting"]:
            print(f"  {r['where'][:55]:55s} {str(r['fit_setting']):36s} error "
                  f"{r['error']:+.0%} (as assumed, not fitting: {r['error_assumed']:+.0%})")
    print(f"rows over {scores.OVER:.0%}: {len(s['over'])}")
    for r, why in s["over"]:
        print(f"  {r['error']:+5.0%} {r['source'][:30]}: {r['where'][:60]}: {why}")


if __name__ == "__main__":
    main()
