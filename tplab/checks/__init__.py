"""The notebook side's verdicts: the same work on the ranks and on one device, compared.

- `grad`: `tplab.grad_check` (one forward and backward); `grad_report` its report;
  `fsdp_report` which mesh dim a wrong gradient comes from under FSDP2 + TP;
  `hf_models` the check of transformers' own models.
- `train`: `tplab.train_check` (a training run, step by step, within a measured noise band:
  `train_band`); `train_report` its report and figure; `train_live` the live figure.
- `cli`: `python -m tplab check`; `doctor` and `smoke`: `python -m tplab doctor`.

The ranks' halves are in tplab/rank/ (grad_step.py, train_step.py).
"""
