"""The answers judged in the notebook alone, from tplab's cost model: no rank runs them, so
they live on the notebook side with the model they call (tplab/cost/), apart from the
answers the ranks run (tplab/core/answers/). `SOLUTIONS` and `MISTAKES` add to theirs.
"""

from __future__ import annotations

from tplab import models
from tplab.cost.lab_models import lab_memory


def block_memory() -> dict:
    """tplab's memory model for the Block at TP 4 with SP (notebook 10 derives it; it
    equals what tplab.memory measures on the ranks)."""
    return {"activation_bytes": lab_memory("block", models.Config(), 4,
                                           sequence_parallel=True)["activation_bytes"]}


def _no_sp_bytes() -> int:
    return lab_memory("block", models.Config(), 4)["activation_bytes"]


SOLUTIONS = {"block_memory": block_memory}
MISTAKES = {
    "block_memory": [("TP without SP", {"activation_bytes": _no_sp_bytes()}, "without SP")],
}
