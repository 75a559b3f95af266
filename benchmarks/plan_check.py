"""What does the static layout check (tplab.plan_check) cost next to the work it guards?

`apply_plan` checks a plan's layouts at the model's first call (a meta-device forward in a
thread of its own); `grad_check` and `python -m tplab check` check once before the ranks
start. Measured side by side in one run, alternated, on one device: `check_layouts` on the
model against one real forward of the same model (the smallest thing any check runs), for
tplab's TinyLM (plans.lm()) and a tiny transformers Llama (plans.from_hf). A ratio under 1
means the check costs less than a single forward.

    scripts/env.sh python benchmarks/plan_check.py
"""

from __future__ import annotations

import statistics
import time

import torch

from tplab import models, plans
from tplab.plan_check import check_layouts


def _llama():
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
        num_key_value_heads=4, num_hidden_layers=4, vocab_size=1024)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model, plans.from_hf(model), {"input_ids": torch.randint(1024, (4, 128))}


def _tinylm():
    cfg = models.Config(vocab_size=1024, dim=256, n_layers=4, n_heads=8, hidden_dim=1024,
                        seq_len=128, batch_size=4)
    return models.TinyLM(cfg), plans.lm(), models.make_tokens(cfg)


def _forward(model, x):
    with torch.no_grad():
        return model(**x) if isinstance(x, dict) else model(x)


def main(repeats: int = 7) -> None:
    for name, make in (("TinyLM 4 layers", _tinylm), ("transformers Llama 4 layers", _llama)):
        model, plan, x = make()
        assert check_layouts(model, plan, x), "the model ran on meta"
        _forward(model, x)  # warm up
        checks, forwards = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            check_layouts(model, plan, x)
            checks.append(time.perf_counter() - t)
            t = time.perf_counter()
            _forward(model, x)
            forwards.append(time.perf_counter() - t)
        c, f = statistics.median(checks), statistics.median(forwards)
        print(f"{name}: check_layouts {c * 1e3:.1f} ms, one forward {f * 1e3:.1f} ms, "
              f"ratio {c / f:.2f}")


if __name__ == "__main__":
    main()
