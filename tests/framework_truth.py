"""An independent judge of the framework checks in tests/test_frameworks.py: plain
torch.distributed on the ranks (each rank's gradient all-gathered whole along the dim the
test's own table says, no tplab check code), compared with a one-device model from the
same weights. Its verdict and flagged tensors are what grad_check's must equal.

The frameworks' parallel state is brought up with the adapters' `init` (which only calls
the framework's own initialisation and its CPU workarounds); cutting the weights,
gathering the gradients and judging them is done here, by other code than tplab's."""

from __future__ import annotations

import functools

import framework_models as fm
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tplab.frameworks import fairscale as ff
from tplab.frameworks import megatron as mf

# which dim each parameter is split on, written from the frameworks' docs, not read
MLP_DIMS = {"embed.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1,
            "down.bias": None}
FFN_DIMS = {"tok_embeddings.weight": 1, "w1.weight": 0, "w3.weight": 0, "w2.weight": 1,
            "output.weight": 0}


def half_square(out: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out ** 2).sum()  # grad_check's default loss


def token_mean(out: torch.Tensor) -> torch.Tensor:
    return out.mean()


def gpt_dim(name: str, p: torch.Tensor) -> int | None:
    """GPTModel's parameters: Megatron's own declaration on the parameter."""
    return int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None


CASES = {  # kind: (init, build(bug), make_input, loss, dim of a parameter)
    "megatron-layers": (mf.init, fm.MegatronMLP, fm.tokens, half_square,
                        lambda n, p: MLP_DIMS[n]),
    "megatron-gpt": (mf.init, fm.gpt, fm.gpt_input, token_mean, gpt_dim),
    "fairscale": (ff.init, fm.FairscaleFFN, fm.tokens, half_square, lambda n, p: FFN_DIMS[n]),
}


def call(model, x):
    return model(**x) if isinstance(x, dict) else model(x)


def parallel_grads(kind: str, bug: bool, state: dict, x) -> dict:
    """On every rank (1-D, tp = world size): the framework's parallel model with this
    rank's chunk of `state`, one forward and backward, every gradient gathered whole."""
    init, build, _, loss_fn, dim_of = CASES[kind]
    tp, rank = dist.get_world_size(), dist.get_rank()
    init(tp)
    model = build(bug)
    dims = {n: dim_of(n, p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            d = dims[name]
            p.copy_(state[name] if d is None else state[name].chunk(tp, d)[rank])
    loss_fn(call(model, x)).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.contiguous()
        if dims[name] is not None:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g)
            g = torch.cat(parts, dims[name])
        grads[name] = g
    return grads


def one_device_grads(kind: str, state: dict, x) -> dict:
    """The one-device model from `state`: plain torch for the layers (a twin written here),
    Megatron's own GPTModel at tp = 1 for GPT."""
    _, build, _, loss_fn, _ = CASES[kind]
    if kind == "megatron-gpt":
        model = mf.reference(build)()
        model.load_state_dict(state, strict=False)
        loss_fn(call(model, x)).backward()
        return {n: p.grad for n, p in model.named_parameters()}
    w = {k: v.clone().requires_grad_(True) for k, v in state.items()}
    loss_fn(TWINS[kind](w, x)).backward()
    return {k: v.grad for k, v in w.items()}


def mlp_twin(w: dict, tokens: torch.Tensor) -> torch.Tensor:
    h = F.gelu(F.embedding(tokens, w["embed.weight"]) @ w["up.weight"].T + w["up.bias"])
    return h @ w["down.weight"].T + w["down.bias"]


def ffn_twin(w: dict, tokens: torch.Tensor) -> torch.Tensor:
    h = F.embedding(tokens, w["tok_embeddings.weight"])
    h = h + (F.silu(h @ w["w1.weight"].T) * (h @ w["w3.weight"].T)) @ w["w2.weight"].T
    return h @ w["output.weight"].T


TWINS = {"megatron-layers": mlp_twin, "fairscale": ffn_twin}


def judge(lab, kind: str, bug: bool, rtol: float = 1e-3) -> set[str]:
    """The parameters whose gathered gradient, on any rank, is off the one-device one by
    more than rtol of its scale."""
    _, build, make_input, _, _ = CASES[kind]
    reference = mf.reference if kind.startswith("megatron") else ff.reference
    state = {k: v for k, v in reference(functools.partial(build, False))().state_dict()
             .items() if isinstance(v, torch.Tensor)}
    x = make_input()
    truth = one_device_grads(kind, state, x)
    flagged = set()
    for grads in lab.run(parallel_grads, kind, bug, state, x):
        for name, g in grads.items():
            t = truth[name]
            if (g - t).abs().max() > rtol * t.abs().max() + 1e-7:
                flagged.add(name)
    return flagged
