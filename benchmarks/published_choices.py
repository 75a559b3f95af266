"""Every constant or choice made while the published errors were visible, with what the
alternative gives (docs/VALIDATION.md, "Frozen protocol"):

    scripts/env.sh python benchmarks/published_choices.py

For each: the median |error| over all rows, the source(s) the choice was read from, and
every source held out (`tplab.cost.scores.leave_one_source_out`, "after"), as chosen and
as the alternative. No GPU is needed.
"""

import contextlib
import dataclasses

from tplab.cost import published, scores, stacks
from tplab.cost.hardware import HARDWARE


@contextlib.contextmanager
def stack_as(name: str, **changes):
    old = stacks.STACKS[name]
    stacks.STACKS[name] = dataclasses.replace(old, **changes)
    try:
        yield
    finally:
        stacks.STACKS[name] = old


@contextlib.contextmanager
def hardware_as(name: str, **changes):
    old = HARDWARE[name]
    HARDWARE[name] = old.with_(**changes)
    try:
        yield
    finally:
        HARDWARE[name] = old


@contextlib.contextmanager
def runs_as(change):
    old = list(published.RUNS)
    published.RUNS[:] = [change(r) for r in old]
    try:
        yield
    finally:
        published.RUNS[:] = old


def figures() -> dict:
    s = scores.score()
    return {"median": s["all"]["median"], "p90": s["all"]["p90"],
            "goal": s["goal"]["median"], "signed": s["all"]["signed"],
            "loso": {k: v["after"] for k, v in s["loso_goal"].items()},
            "memory": s["memory"]["within_10"], "not_fit": len(s["memory"]["not_fitting"])}


def show(name: str, chosen: dict, other: dict, sources: tuple[str, ...]) -> None:
    print(f"\n{name}")
    for label, f in (("chosen", chosen), ("alternative", other)):
        read = ", ".join(f"{s.split(' ')[0][:24]} {f['signed'][s]:+.1%}" for s in sources)
        worst = max(f["loso"].values())
        print(f"  {label:11s} median |error| {f['median']:5.1%} (goal set {f['goal']:5.1%}), "
              f"p90 {f['p90']:5.1%}; read "
              f"from: {read}; held out, worst source {worst:5.1%}; peaks within 10% "
              f"{f['memory']}/18, runs not fitting {f['not_fit']}")


def main() -> None:
    base = figures()
    a100, titan_h100 = published.FOUNDRY, published.TITAN_H100   # noqa: F841
    with stack_as("llm-foundry-2023", attention_scale=1.0):
        show("llm-foundry-2023 attention at FA1's rate (0.65 x FA2) vs FA2's", base,
             figures(), (a100,))
    with stack_as("llm-foundry-2023", fsdp_exposed=False):
        show("llm-foundry-2023 FSDP sync exposed per micro-batch vs hidden", base, figures(),
             (a100,))
    with stack_as("torchtitan", logits_bytes=8), stack_as("torchtitan+compile",
                                                          logits_bytes=8):
        show("torchtitan's loss keeps 10 bytes per logit vs Megatron's 8", base, figures(),
             (titan_h100,))
    for name in ("H100 SXM", "H100 96GB (500 W)", "A100 SXM", "B200", "GB200 NVL72"):
        on = tuple(dict.fromkeys(r["source"] for r in published.RUNS
                                 if r["hardware"] == name))
        with hardware_as(name, sustained=1.0):
            show(f"{name}: sustained (MSMF / MAMF) vs 1 (MAMF alone)", base, figures(), on)
    with runs_as(lambda r: r | {"hardware": "H100 SXM"} if r["hardware"] ==
                 "H100 96GB (500 W)" else r):
        show("torchtitan's H100s as the 500 W preset vs the 700 W H100 SXM", base,
             figures(), (titan_h100, published.TITAN))
    with runs_as(lambda r: r | {"excluded": ""}):
        show("goal set without the exclusion rule (every row in)", base, figures(),
             (published.NARAYANAN,))


if __name__ == "__main__":
    main()
