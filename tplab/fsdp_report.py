"""Notebook side of FSDP2 + TP in `tplab.grad_check`: which mesh dim a wrong gradient comes from.

On a (dp, tp) mesh the right gradient of a parameter is FSDP2's (and DDP's) average over dp of
each replica's gradient on its own slice of the batch: T = mean_d g_d. `replica_grads` computes
every g_d on one device (the reference model, from the same weights, on slice d). A wrong
gradient G then comes from:

- the **dp** dim when a way of combining the replicas' right gradients explains it: the sum
  (dp x T: a missing divide by dp), a second average (T / dp), or one replica's own g_d (no
  reduction over dp at all);
- the **tp** dim otherwise: each replica's gradient was wrong before anything was averaged
  over dp (TP's collectives, a layout, or tp ranks of one replica that saw different rows).

`name_mesh_dims(rows, wholes, replicas, dp)` writes that into each wrong "param_grad" row
(`row["mesh_dim"]`, and the note).
"""

from __future__ import annotations

import dataclasses

from tplab.core.pytrees import call_model, map_tensors
from tplab.losses import call_loss, with_grad

__all__ = ["dims_of", "explain", "name_mesh_dims", "replica_grads"]


def replica_grads(build_model, state: dict, x, loss_fn, dp: int) -> list[dict]:
    """[{parameter name: gradient of replica d's loss on its slice d of the batch}] (one
    device, the reference model from `state`)."""
    out = []
    for d in range(dp):
        model = build_model()
        model.load_state_dict(state)
        part = map_tensors(lambda t, d=d: t.chunk(dp)[d], with_grad(x))
        call_loss(loss_fn, call_model(model, part), part).backward()
        out.append({n: None if p.grad is None else p.grad.detach().clone()
                    for n, p in model.named_parameters()})
    return out


def _close(a, b, tol: float) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        float((a.double() - b.double()).abs().max()) <= tol


def explain(whole, grads: list, dp: int, atol: float, rtol: float) -> tuple[str, str]:
    """(mesh dim, why) for a wrong gradient `whole` given the replicas' right ones."""
    if whole is None or any(g is None for g in grads):
        return "", ""
    truth = sum(grads[1:], grads[0]) / dp
    tol = atol + rtol * float(truth.abs().max())
    if _close(whole, truth * dp, tol):
        return "dp", (f"it is the SUM of the {dp} dp replicas' gradients, not their mean "
                      "(FSDP2 averages over dp): a missing divide by dp")
    if _close(whole, truth / dp, tol):
        return "dp", f"it is the mean over dp divided by {dp} again: averaged over dp twice"
    for d, g in enumerate(grads):
        if _close(whole, g, tol):
            return "dp", (f"it is dp replica {d}'s own gradient: it was not reduced over dp "
                          "(FSDP2's reduce-scatter, or DDP's all-reduce, is missing)")
    return "tp", ("wrong inside a dp replica, before any average over dp (no combination "
                  "of the replicas' right gradients gives it)")


def name_mesh_dims(rows: list[dict], wholes: dict, replicas: list[dict], dp: int,
                   atol: float, rtol: float) -> None:
    """Give every wrong "param_grad" row its mesh dim (`row["mesh_dim"]`) and say why
    (each such row replaced, in place in `rows`)."""
    for i, row in enumerate(rows):
        if row["kind"] != "param_grad" or row["ok"] or row["name"] not in wholes:
            continue
        grads = [r.get(row["name"]) for r in replicas]
        dim, why = explain(wholes[row["name"]], grads, dp, atol, rtol)
        if dim:
            rows[i] = dataclasses.replace(row, mesh_dim=dim, note=f"from the {dim} dim: {why}"
                                          + (f"; {row['note']}" if row["note"] else ""))


def dims_of(report) -> dict[str, str]:
    """{parameter name: mesh dim} of a report's wrong gradients (what the lesson shows)."""
    return {r["name"]: r["mesh_dim"] for r in report.rows if r.get("mesh_dim")}

