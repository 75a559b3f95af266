"""The lab's own models on paper: which collectives `tplab.models.MLP` and `Block` issue
under the lab's plans, so that the model can be checked against `tplab.trace` byte for byte.

Two plans, both on a standalone model whose input requires grad (as every layer's input
does inside a network):

- "megatron": `tplab.megatron.parallelize`, one f (or one all-gather under SP) per region:
  exactly `block_collectives`. Under SP its norms (and the MLP's row-parallel bias) see
  sequence shards, so their gradients are partial and a hook all-reduces each one
  (dim x dtype bytes) in backward.
- "dtensor": `tplab.plans.mlp()` / `tplab.plans.block(sp)` through `parallelize_module`.
  Without SP, ColwiseParallel turns each column-parallel linear's input into a DTensor of its
  own, so the backward costs one all-reduce per such linear (wq, wk, wv; w1, w3) where
  Megatron's single f costs one per region (docs/DESIGN.md). Under SP it matches Megatron, and
  the norm gradients stay Partial DTensors (reduced when used, not in this step).

Under SP the standalone model takes and returns the whole sequence: it all-gathers its
output in forward, and the gradient of its sequence-split input in backward.
"""

from __future__ import annotations

from tplab.cost.memory import tplab_layer
from tplab.cost.shapes import BlockShape
from tplab.cost.transformer import block_collectives
from tplab.cost.validate import check_choice


def lab_shape(cfg, kind: str = "block", dtype_bytes: int = 4) -> BlockShape:
    """A `tplab.models.Config` as a BlockShape (float32: 4 bytes per element)."""
    return BlockShape(hidden=cfg.dim, heads=cfg.n_heads, ffn=cfg.hidden_dim,
                      gated=kind == "block", seq=cfg.seq_len, batch=cfg.batch_size,
                      dtype_bytes=dtype_bytes, name=f"tplab {kind}")


def _kind(model) -> str:
    name = model if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
    kind = {"mlp": "mlp", "block": "block"}.get(name.lower())
    if kind is None:
        raise ValueError(f"lab_collectives knows tplab.models.MLP and Block, not {name!r}")
    return kind


def lab_collectives(model, cfg, tp: int, sequence_parallel: bool = False,
                    plan: str = "megatron") -> list[dict]:
    """Predicted trace records (phase, module, op, bytes, group_size) of one forward and
    backward of the lab's `model` ("mlp", "block", or the class or an instance) built from
    `cfg`, with `tp` ranks, under `plan` ("megatron" or "dtensor"); see the module doc."""
    kind, sp = _kind(model), sequence_parallel
    if plan not in ("megatron", "dtensor"):
        raise ValueError(f"plan must be 'megatron' or 'dtensor', not {plan!r}")
    if plan == "dtensor" and sp and kind == "mlp":
        raise ValueError("tplab.plans has no sequence-parallel plan for the MLP")
    if tp <= 1:
        return []
    shape = lab_shape(cfg, kind)
    regions = ("",) if kind == "mlp" else ("attention", "feed_forward")   # module paths
    records = block_collectives(shape, tp, sp, regions)

    def rec(phase, module, op, nbytes=shape.activation_bytes):
        return {"phase": phase, "module": module, "op": op, "bytes": nbytes, "group_size": tp}

    forward = [r for r in records if r["phase"] == "forward"]
    backward = [r for r in records if r["phase"] == "backward"]
    if plan == "dtensor" and not sp:
        colwise = {"": ("w1",), "attention": ("wq", "wk", "wv"), "feed_forward": ("w1", "w3")}
        backward = [rec("backward", f"{region}.{linear}".lstrip("."), "all_reduce")
                    for region in reversed(regions) for linear in reversed(colwise[region])]
    if sp:
        forward.append(rec("forward", "", "all_gather"))     # the whole output
        if plan == "megatron" and kind == "block":          # partial norm weight grads
            at = {"feed_forward": "ffn_norm", "attention": "attention_norm"}
            backward = [r for region in reversed(regions) for r in
                        [*(b for b in backward if b["module"] == region),
                         rec("backward", at[region], "all_reduce", cfg.dim * shape.dtype_bytes)]]
        if plan == "megatron" and kind == "mlp":            # w2's bias adds on sequence
            backward.insert(0, rec("backward", "w2", "all_reduce",   # shards: partial grad
                                   cfg.dim * shape.dtype_bytes))
        backward.append(rec("backward", "", "all_gather"))   # the whole input's gradient
    return forward + backward


# What a CUDA rank saves differently from a CPU rank, measured on an H200 (torch 2.11,
# benchmarks/gpu_memory.py; docs/VALIDATION.md, "The GPU path on one H200"): RMSNorm runs
# torch's fused kernel, which keeps its input and rstd (tplab_layer(norm="fused")), and
# float32 attention takes the memory-efficient kernel, which also keeps its random-number
# state, a seed and an offset (one int64 each, on the host), and pads its logsumexp to a
# multiple of LSE_ALIGN positions of the query.
RNG_STATE = (8, 8)
LSE_ALIGN = 32
DEVICES = ("cpu", "cuda")


def lab_memory(model, cfg, tp: int, sequence_parallel: bool = False,
               device: str = "cpu") -> dict:
    """What `tplab.memory` measures on one rank for one forward and backward of the lab's
    `model` ("mlp" or "block") from `cfg` with `tp` ranks, under either plan (megatron or
    dtensor: both save the same tensors): param_bytes, grad_bytes, optimizer_bytes (Adam's
    two fp32 moments), activation_bytes, peak_bytes and rows (module, bytes, storages) in
    the order the modules first save; nothing checkpointed, so nothing recomputed. Float32
    throughout; see `tplab.cost.memory`. `device`: where the ranks compute, "cpu" (gloo)
    or "cuda" (NCCL: `tplab.mesh.device_type()` on a rank); a CUDA rank's norms and
    attention keep other tensors (RNG_STATE, LSE_ALIGN)."""
    check_choice("device", device, DEVICES)
    kind = _kind(model)
    shape = lab_shape(cfg, kind)
    d, f = cfg.dim, cfg.hidden_dim
    if kind == "mlp":   # w1 (f, d) + bias (f) split by rows; w2 (d, f) split by columns
        sharded, whole = f * d + f + d * f, d
        saved = tplab_layer(shape, ("mlp",))
    else:               # q, k, v, o (d, d); w1, w3 (f, d), w2 (d, f); two norm weights
        sharded, whole = 4 * d * d + 3 * d * f, 2 * d
        saved = tplab_layer(shape, norm="fused" if device == "cuda" else "composite")
    sizes = {"hidden_dim": f} | ({"n_heads": cfg.n_heads} if kind == "block" else {})
    if sequence_parallel:
        sizes["seq_len"] = cfg.seq_len
    bad = [f"{name} = {size}" for name, size in sizes.items() if size % tp]
    if bad:
        raise ValueError(f"lab_memory: {', '.join(bad)} not divisible by tp = {tp}")
    params = 4 * (sharded // tp + whole)
    rows: dict[str, dict] = {}
    for item in saved:
        row = rows.setdefault(item.module, {"module": item.module, "bytes": 0, "storages": 0})
        row["bytes"] += item.local_bytes(shape.tokens, tp, sequence_parallel)
        row["storages"] += 1
    if device == "cuda" and kind == "block":
        row = rows["attention"]
        padded = -(-cfg.seq_len // LSE_ALIGN) * LSE_ALIGN
        row["bytes"] += 4 * cfg.batch_size * (cfg.n_heads // tp) * (padded - cfg.seq_len)
        row["bytes"] += sum(RNG_STATE)
        row["storages"] += len(RNG_STATE)
    total = sum(r["bytes"] for r in rows.values())
    return {"param_bytes": params, "grad_bytes": params, "optimizer_bytes": 2 * params,
            "activation_bytes": total, "peak_bytes": total, "rows": list(rows.values()),
            "recomputed_bytes": 0, "recomputed_rows": []}
