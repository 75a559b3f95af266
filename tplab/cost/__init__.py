"""What a TP plan would cost at scale: an alpha-beta model of collectives, a transformer
block's bytes and FLOPs, hardware presets, and a calibration of this machine.

    from tplab import cost
    cost.collective_time("all_reduce", 64 * 2**20, 8, cost.HARDWARE["H100 SXM"])
    cost.sweep(cost.MODELS["Llama-3 70B"], cost.HARDWARE["H100 SXM"])
    cal = cost.calibrate(lab)          # real ranks only; cal.hardware is "this machine"

Sources are cited in each submodule: `hardware` (datasheets, published nccl-tests bus
bandwidth, NCCL's latencies; NICs striped between nodes), `collectives` (ring, tree and
NVLS algorithms), `transformer` (Megatron-LM, Korthikanti et al. 2022, the Ultra-Scale
Playbook, the JAX scaling book), `memory` (per-GPU memory: ZeRO's bytes per parameter,
Korthikanti et al. 2022's activations, tplab's own block), `calibrate` (the fit). Also:
`lab_models` (the lab's own MLP and Block under its plans, checked against `tplab.trace`
and `tplab.memory`), `figures` (plotly) and
`explorer` (an ipywidgets explorer); those two import plotly and ipywidgets, so they are
not imported here.
"""

from tplab.cost.calibrate import Calibration, calibrate
from tplab.cost.collectives import OPS, collective_terms, collective_time, records_time
from tplab.cost.hardware import GPU_MEMORY, HARDWARE, LINKS, Hardware, Link
from tplab.cost.memory import activation_bytes, gpu_memory, layer_saved, param_count
from tplab.cost.transformer import (
    MFU,
    MODELS,
    OVERLAPS,
    BlockShape,
    best_tp,
    block_collectives,
    block_flops,
    comm_bound_tp,
    comm_times,
    mlp_comm_ratio,
    scaled,
    step_time,
    sweep,
)

__all__ = [
    "GPU_MEMORY", "HARDWARE", "LINKS", "MFU", "MODELS", "OPS", "OVERLAPS", "BlockShape",
    "Calibration",
    "Hardware", "Link",
    "best_tp", "block_collectives", "block_flops", "calibrate", "collective_terms",
    "collective_time", "comm_bound_tp", "comm_times", "mlp_comm_ratio", "records_time", "scaled",
    "step_time", "sweep", "activation_bytes", "gpu_memory", "layer_saved", "param_count",
]
