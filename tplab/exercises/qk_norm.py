"""The exercise "qk_norm_grad" (notebook 11): the gradient of Qwen3's q_norm weight under TP.

q_norm is an RMSNorm over head_dim with ONE weight shared by every head. Under TP each rank
holds its own heads (q_proj is column-parallel), so each rank's dL/dw sums over its heads
only: a partial gradient. The whole gradient is the sum over ranks, the rule of Megatron's
f (dL/dx = sum over ranks of each rank's term) in its weight form; transformers'
`replicated_with_grad_allreduce` style all-reduces it (tplab.parallel_styles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tplab.exercises.feedback import close, fail, fmt_counts, max_diff, run_on_ranks, spread
from tplab.rank.qk_norm_step import qk_norm_step

TITLE = "The gradient of Qwen3's q_norm weight under TP"
TASK = ("def answer(grad, group) -> grad: a hook on q_norm's replicated weight (one weight "
        "of head_dim, shared by every head), whose rank holds only its own heads' "
        "activations. Return the gradient the single-device model would have, on every rank.")
HINTS = ("dL/dw = sum over heads of each head's term. Which heads does this rank see?",
         "Each rank's grad is the sum over its own heads: a partial sum. The rest is on the "
         "other ranks. Sum, do not average: every head counts once.",
         "grad = grad.clone(); dist.all_reduce(grad, group=group); return grad")


def check_qk_norm_grad(name, answer, lab):
    if not callable(answer):
        raise fail(name, f"the answer is a function answer(grad, group) -> grad, not "
                         f"{type(answer).__name__} {answer!r}")
    n = lab.world_size
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 2 * n, 8, generator=g)          # 2 heads per rank, head_dim 8
    dy = torch.randn(q.shape, generator=g)
    weight = 1 + 0.1 * torch.randn(8, generator=g)
    w = weight.clone().requires_grad_()
    F.rms_norm(q, (8,), w, eps=1e-6).backward(dy)         # the single device: every head
    res = run_on_ranks(name, lab, qk_norm_step, answer, q, weight, dy)
    grads = [r["grad"] for r in res]
    if any(not isinstance(x, torch.Tensor) or x.shape != w.grad.shape for x in grads):
        raise fail(name, "your hook must return a tensor shaped like the gradient it got "
                         f"({tuple(w.grad.shape)}), on every rank")
    if all(close(x, w.grad) for x in grads):
        counts = res[0]["counts"].get("backward", {})
        return (f"right: {fmt_counts(counts)} in backward, the weight's gradient the sum of "
                f"the {n} ranks' heads' terms on every rank")
    if n > 1 and all(close(x * n, w.grad) for x in grads):
        raise fail(name, f"your gradient is {1 / n:.3g} x the single device's: an average "
                         "over the ranks; each rank's term covers different heads, so the "
                         "whole gradient is their sum, not their mean")
    if n > 1 and spread(grads) > 1e-5:
        raise fail(name, f"the gradient differs across ranks by up to {spread(grads):.3g}: "
                         "each rank's gradient covers only its own heads (a partial sum); "
                         "sum it over the tp group")
    raise fail(name, f"on rank 0 the gradient differs from the single device's by up to "
                     f"{max_diff(grads[0], w.grad):.3g}")
