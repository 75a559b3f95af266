"""The rank side: what runs inside each rank process (an ipyparallel engine) and the
processes beside it. It imports tplab/core/ (both sides) and nothing of the notebook side
(tplab/lab/, viz/, checks/, cost/, exercises/): no IPython display, no ipyparallel client,
no plotly or ipywidgets (tests/test_imports.py checks, from each module's path).

- `runner`: the functions the notebook sends by reference (set up a rank, run a cell,
  send results back); `collectives`: which collectives this rank issued and where it waits;
- `entry`: `python -m tplab.rank.entry engine|controller|zygote`, the processes a lab starts;
  `stream`: a rank's stdout and stderr (the engine's out_stream_factory);
- `output_relay`: `python -m tplab.rank.output_relay`, a rank's output to the notebook from
  another host;
  `network`: where a rank is reachable; `torch_log`: torch's log of a failed propagation;
  `whereabouts`: where this rank is, for the notebook's watchdog;
- the rank halves of the notebook's checks: `grad_step` (tplab.grad_check), `train_step`
  (tplab.train_check), `explore_step` (the Explorer), `exercise_steps` and `qk_norm_step`
  (the exercises).
"""
