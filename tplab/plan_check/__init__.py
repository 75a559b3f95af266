"""Does a plan fit the model? Checked on one device, before anything reaches the ranks.

- `fit`: the checks and their entry points: every key matches a module, each style fits its
  module, tp divides what it splits (`check_plan`, `check_vocab`), and the layouts chain
  along the model's dataflow (`check_layouts`: one forward on the meta device;
  `check_at_first_call` for `apply_plan` without an example input).
- `tags`: the tag each activation carries in that forward (`Flow`: the layout it would have
  on the ranks) and the TorchFunctionMode that moves it through the ops (`Tracer`).
- `handovers`: each hand-over from one module to the next, checked (`Edge`, `HandoverHooks`).
- what each style splits, reads and hands on is its `tplab.style_specs.StyleSpec`.
"""

from tplab.plan_check.fit import (
    PLAN_KINDS,
    PlanCheckSkipped,
    check_at_first_call,
    check_layouts,
    check_plan,
    check_plan_type,
    check_tp,
    check_vocab,
    match,
    padded_vocab,
    skipped_because,
    styles_by_module,
)
from tplab.plan_check.handovers import Edge

__all__ = ["PLAN_KINDS", "Edge", "PlanCheckSkipped", "check_at_first_call", "check_layouts",
           "check_plan", "check_plan_type", "check_tp", "check_vocab", "match", "padded_vocab",
           "skipped_because", "styles_by_module"]
