"""Rank side of the check of transformers' own models (tplab/hf_models.py): the loss
every check of them takes, and the collectives of decoder layer 0 under a plan."""

from __future__ import annotations

import torch.distributed as dist

from tplab.mesh import make_mesh
from tplab.plans import parallelizer
from tplab.tracing import trace


def logits_loss(out):
    """The mean square of the logits: every logit gets a gradient."""
    return out.logits.float().pow(2).mean()


def layer_counts(build_model, state, plan, x) -> dict:
    """The collectives of decoder layer 0, forward and backward, from a trace."""
    model = build_model()
    model.load_state_dict(state)
    mesh = make_mesh(tp=dist.get_world_size())
    model = parallelizer(plan)(model, mesh)
    with trace() as t:
        logits_loss(model(**x)).backward()
    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for r in t.records:
        if ".layers.0." in f".{r.get('module') or ''}.":
            phase = counts.setdefault(r["phase"], {})
            phase[r["op"]] = phase.get(r["op"], 0) + 1
    return counts
