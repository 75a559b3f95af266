"""Both sides, beneath the public modules: what tplab's library (tplab/plans.py,
tplab/megatron/, tplab/training/, ... at the top of the package) is built on, and the plain
data both sides exchange. No learner needs to name it: `output` (grouping lines), `transfer`
(a rank's tensors to the notebook), `placements` (placement names), `ops` (the op table),
`pytrees`, `pairing` (pairing and assembling shards), `fsdp_layout`, `memory_use`
(tplab.memory) and `answers` (the exercises' solutions and mistakes). Nothing here imports the
notebook side (IPython, the ipyparallel client, plotly, ipywidgets, tplab/lab/, tplab/viz/, ...;
tests/test_imports.py).
"""
