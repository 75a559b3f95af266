"""What a TP plan would cost at scale: NCCL's cost model of collectives, a transformer
block's bytes and FLOPs, hardware presets, and a calibration of this machine.

    from tplab import cost
    cost.collective_time("all_reduce", 64 * 2**20, 8, cost.HARDWARE["H100 SXM"])
    cost.sweep(cost.MODELS["Llama-3 70B"], cost.HARDWARE["H100 SXM"])
    cal = cost.calibrate(lab)          # real ranks only; cal.hardware is "this machine"

Sources are cited in each submodule: `hardware` (datasheets, published nccl-tests bus
bandwidth; NICs striped between nodes), `collectives` and `nccl` (NCCL 2.21.5's tuning
model: ring, tree, NVLS, CollNet x LL, LL128, Simple), `transformer` (Megatron-LM,
Korthikanti et al. 2022, the Ultra-Scale Playbook, the JAX scaling book), `memory`
(per-GPU memory: Megatron-LM's and ZeRO's bytes per parameter, Korthikanti et al. 2022's
activations, tplab's own block), `kernels` (the one GEMM model, `gemm_efficiency`, and
the step's other kernels), `data_parallel` (DP
gradient and ZeRO traffic), `step` (a step's time and the TP degree rows recommend),
`validate` (one check of every input), `calibrate` (the fit), `training_run` (a whole
run: `TrainingRun`, `predict`), `layout_search` (the layout search over runs: `layouts`,
`best_layout`), `stacks` (the software a run runs on: `STACKS`,
`DEFAULT_STACK`), with `kernels` and `pipeline`, `published` (the published runs it is
checked against, data files in tplab/cost/data/, docs/VALIDATION.md) and `scores` (the
goal figures). Also: `lab_models` (the
lab's own MLP and Block under its plans, checked against `tplab.trace` and
`tplab.memory`), `figures` (plotly) and `explorer` (an ipywidgets explorer); those two
import plotly and ipywidgets, so they are not imported here.
"""

from tplab.cost.calibrate import Calibration, calibrate
from tplab.cost.collectives import (
    ALGORITHMS,
    OPS,
    PROTOCOLS,
    collective_plan,
    collective_terms,
    collective_time,
    records_time,
)
from tplab.cost.data_parallel import dp_collectives, dp_times
from tplab.cost.hardware import GPU_MEMORY, HARDWARE, LINKS, Hardware, Link
from tplab.cost.kernels import gemm_efficiency
from tplab.cost.layout_search import best_layout, layouts
from tplab.cost.memory import (
    BLOCK_SAVES,
    PRECISIONS,
    activation_bytes,
    gpu_memory,
    layer_saved,
    param_count,
)
from tplab.cost.shapes import MODELS, BlockShape, scaled
from tplab.cost.stacks import DEFAULT_STACK, STACKS, Stack
from tplab.cost.step import (
    best_tp,
    comm_bound_tp,
    comm_times,
    gemm_times,
    mlp_comm_ratio,
    step_time,
    sweep,
)
from tplab.cost.training_run import Prediction, TrainingRun, predict
from tplab.cost.transformer import (
    MFU,
    OVERLAPS,
    allowed_tps,
    block_collectives,
    block_flops,
    lm_head_flops,
    tp_allowed,
)

__all__ = [
    "Prediction", "TrainingRun", "best_layout", "layouts", "predict",
    "DEFAULT_STACK", "STACKS", "Stack",
    "ALGORITHMS", "BLOCK_SAVES", "GPU_MEMORY", "HARDWARE", "LINKS", "MFU", "MODELS", "OPS",
    "OVERLAPS", "PRECISIONS", "PROTOCOLS", "BlockShape", "Calibration", "Hardware", "Link",
    "activation_bytes", "allowed_tps", "best_tp", "block_collectives", "block_flops",
    "calibrate", "collective_plan", "collective_terms", "collective_time", "comm_bound_tp",
    "comm_times", "dp_collectives", "dp_times", "gemm_efficiency", "gemm_times",
    "gpu_memory", "layer_saved", "lm_head_flops", "mlp_comm_ratio", "param_count",
    "records_time", "scaled", "step_time", "sweep", "tp_allowed",
]
