"""The data-parallel traffic of a TP layout: gradient reduction and ZeRO's gathers.

With `dp` data-parallel replicas of a TP group, each GPU's replica of its 1/tp of the model
synchronises with the `dp` GPUs that hold the same shard (Megatron-LM's DP groups: the same
TP rank in every replica):

| zero | once per optimizer step | per micro-batch |
|---|---|---|
| 0 | all-reduce of the gradients (N x grad bytes) | - |
| 1 | reduce-scatter of the gradients, all-gather of the updated bf16 parameters | - |
| 2 | all-gather of the updated bf16 parameters | reduce-scatter of the gradients |
| 3 | - | reduce-scatter of the gradients; all-gather of the parameters, forward and backward |

(Rajbhandari et al. 2020, "ZeRO", section 7: stages 1 and 2 move what an all-reduce moves,
stage 3 1.5 times that; Megatron-LM's distributed optimizer is stage 1, its gradient
buffers fp32 under `--bf16`.) N is the parameter count on one GPU (`param_count(shape, tp)`).

Where: the DP group of a GPU has `gpus_per_node // tp` members in each node (one when TP
fills the node or spans nodes), and all the node's DP groups reduce at once, so each gets
its share of the node's NICs: `gpus_per_node // tp` of them, one NIC per GPU. NCCL's
model (`tplab.cost.nccl`, algorithm "auto") prices each collective on that fabric.

Overlap (`overlap=True`, Megatron-LM's `--overlap-grad-reduce` and
`--overlap-param-gather`): the gradient reduction runs behind the backward pass of the
step's last micro-batch, the parameter gather behind the next forward pass, ZeRO-3's
gathers behind the micro-batch's compute; what does not fit stays exposed (ideal overlap,
a lower bound; `sync_seconds`, the rule `TrainingRun` uses too). The per-step traffic is
spread over the step's `micro_batches`.
"""

from __future__ import annotations

from tplab.cost.collectives import collective_time
from tplab.cost.hardware import Hardware
from tplab.cost.memory import GRAD_BYTES, PARAM_BYTES, check_sharding, param_count
from tplab.cost.shapes import BlockShape
from tplab.cost.validate import check_bool, check_int, check_number, check_type


def dp_group_hardware(hw: Hardware, tp: int) -> Hardware:
    """The fabric one DP group sees: `gpus_per_node // tp` GPUs per node (at least 1), each
    with one NIC's share of the node's `nics_per_node`."""
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    check_int("tp", tp)
    per_node = max(1, hw.gpus_per_node // tp)
    nic = hw.inter.bandwidth * min(1.0, hw.nics_per_node / hw.gpus_per_node)
    return hw.with_(name=f"{hw.name}, DP group", gpus_per_node=per_node,
                    nics_per_node=per_node, inter=hw.inter.with_(bandwidth=nic))


def dp_collectives(shape: BlockShape, tp: int, dp: int, zero: int = 0,
                   precision: str = "mixed") -> list[dict]:
    """The DP records of one GPU, trace-like (op, bytes, group_size) with `per`: "step"
    (once per optimizer step) or "micro_batch"; see the module doc."""
    check_sharding(shape, tp, dp, zero, precision)
    if dp == 1:
        return []
    n = param_count(shape, tp)
    grads, params = n * GRAD_BYTES[precision], n * PARAM_BYTES[precision]

    def rec(op, nbytes, per, what):
        return {"op": op, "bytes": nbytes, "group_size": dp, "per": per, "what": what}

    if zero == 0:
        return [rec("all_reduce", grads, "step", "gradients")]
    # sharded gradients (stages 2, 3) cannot accumulate whole: reduce-scattered every
    # micro-batch (ZeRO section 5.2; DeepSpeed and FSDP do), where stage 1 keeps a whole
    # gradient buffer and reduce-scatters it once per step (Megatron-LM)
    out = [rec("reduce_scatter", grads, "step" if zero == 1 else "micro_batch", "gradients")]
    if zero < 3:
        return out + [rec("all_gather", params, "step", "updated parameters")]
    return out + [rec("all_gather", params, "micro_batch", "parameters, forward"),
                  rec("all_gather", params, "micro_batch", "parameters, backward")]


def dp_times(shape: BlockShape, tp: int, hw: Hardware, dp: int = 1, zero: int = 0,
             precision: str = "mixed", micro_batches: int = 1, overlap: bool = True,
             forward_s: float = 0.0, backward_s: float = 0.0) -> dict:
    """Per micro-batch: `dp_comm_s` (all of the DP traffic) and `dp_exposed_s` (what
    `overlap` leaves on the critical path, given the micro-batch's forward and backward
    compute seconds), with `dp_link` (the fabric) and the `dp_records`."""
    check_int("micro_batches", micro_batches)
    check_bool("overlap", overlap)
    check_number("forward_s", forward_s)
    check_number("backward_s", backward_s)
    records = dp_collectives(shape, tp, dp, zero, precision)
    view = dp_group_hardware(hw, tp)
    for r in records:
        r["time_s"] = collective_time(r["op"], r["bytes"], dp, view, "auto")
    one = {r["op"]: r["time_s"] for r in records}
    comm, exposed = sync_seconds(zero, one.get("all_reduce", 0.0),
                                 one.get("reduce_scatter", 0.0), one.get("all_gather", 0.0),
                                 forward_s, backward_s, micro_batches, overlap,
                                 waits=not overlap)
    return {"dp_comm_s": comm / micro_batches, "dp_exposed_s": exposed / micro_batches,
            "dp_link": view.link(dp).name if dp > 1 else "-", "dp_records": records}


def sync_seconds(zero: int, ar: float, rs: float, ag: float, fwd: float, bwd: float,
                 m: int, overlap: bool = True, waits: bool = False,
                 gathers: int = 2) -> tuple[float, float]:
    """One optimizer step's DP seconds at ZeRO stage `zero` (`memory.ZERO_STAGES`), all of
    it and what stays exposed: the one rule `dp_times` and `TrainingRun`
    (`tplab.cost.pipeline.data_parallel`) both use. `ar`, `rs`, `ag`: one all-reduce,
    reduce-scatter, all-gather of the gradients / parameters; `fwd`, `bwd`: one
    micro-batch's compute seconds; `m` micro-batches. Stages 0 and 1 reduce once, behind
    the last backward (`overlap`; else after it), and gather once, behind the next
    forward; stage 2 reduce-scatters every micro-batch behind its backward; stage 3 also
    gathers `gathers` times a micro-batch (2: again for backward, resharded after
    forward; 1 under pipeline parallelism), the first behind the forward, the rest with
    the reduce-scatter behind the backward. `waits`: stages 2 and 3 sync in the open (a
    stack that does not prefetch, `Stack.fsdp_exposed`)."""
    if not overlap:
        fwd = bwd = 0.0
    if zero == 0:
        return ar, max(0.0, ar - bwd)
    if zero == 1:
        return rs + ag, max(0.0, rs - bwd) + max(0.0, ag - fwd)
    if zero == 2:
        return m * rs + ag, m * (rs if waits else max(0.0, rs - bwd)) + max(0.0, ag - fwd)
    per_mb = (gathers * ag + rs if waits
              else max(0.0, ag - fwd) + max(0.0, (gathers - 1) * ag + rs - bwd))
    return m * (gathers * ag + rs), m * per_mb


def gather_copy_seconds(elements: float, fp8_elements: float, hw: Hardware) -> float:
    """Seconds FSDP2 copies one all-gather's output into the unsharded parameters on the
    compute stream (`Stack.gather_copy`; torch's `foreach_all_gather_copy_out`,
    torch/distributed/_composable/fsdp/_fsdp_collectives.py at 01d66d21: the current stream
    waits on the all-gather's event, then `torch.split_with_sizes_copy` reads the gathered
    buffer and writes each parameter): `elements` gathered, `fp8_elements` of them in fp8
    (1 byte, `Stack.fp8_gathers`), the rest in bf16, each read once and written once, at
    the memory bandwidth."""
    check_number("elements", elements)
    check_number("fp8_elements", fp8_elements, maximum=elements)
    check_type("hw", hw, Hardware, "a tplab.cost.Hardware")
    bf16 = PARAM_BYTES["mixed"] * (elements - fp8_elements)
    return 2 * (bf16 + fp8_elements) / hw.achievable_bandwidth
