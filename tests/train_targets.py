"""Targets for `python -m tplab check --train` in tests/test_training.py (imported by name)."""

from __future__ import annotations

import functools

from tplab import megatron, models
from tplab.training import lm, steps

CFG = models.Config(vocab_size=16, dim=8, n_layers=1, n_heads=2, hidden_dim=16, seq_len=4,
                    batch_size=2)
build = functools.partial(models.TinyLM, CFG)
make_batch = lm.counting_batches(CFG)
step = functools.partial(steps.lm_step, max_norm=0.5)
missing_f = functools.partial(megatron.parallelize, reduce_grad=False)
