"""Both sides: the tensor-parallel library a rank runs, that `tplab.simulate` runs in the
notebook too, and the plain data both sides exchange. Nothing here imports the notebook side
(IPython, the ipyparallel client, plotly, ipywidgets, tplab/lab/, tplab/viz/, ...); a module's
side is where it lives (tests/test_imports.py): tplab/core/ both, tplab/rank/ the ranks, the
rest the notebook.

- What a cell calls on the ranks: `mesh` (make_mesh), `plans` (apply_plan, the named plans),
  `plan_check` (does a plan fit, before anything runs), `megatron` (hand-written f, g and
  parallel layers), `models`, `rng` (dropout under TP), `tracing` (tplab.trace), `causes` and
  `explain` (why each collective), `memory_use` (tplab.memory), `hf` and `parallel_styles`
  (transformers' models), `fsdp`, `checkpointing`, `compiling`, `training` (clipping, the
  reduction-order noise, a language model and its steps), `answers` (the exercises').
- What both sides share: `errors`, `output`, `transfer` (a rank's tensors to the notebook),
  `placements`, `layouts`, `fsdp_layout`, `pairing`, `ops`, `pytrees`, `platforms`,
  `lessons`.
"""
