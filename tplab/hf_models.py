"""Tiny transformers decoders built from their configs, and each checked under its
published TP plan both ways: transformers' own code (`hf.apply_transformers_plan`) and
tplab's translation (`hf.from_hf`). Nothing is downloaded: the weights are random.

- `decoder_families()`: every transformers model type with a causal-LM head whose config
  publishes a `base_model_tp_plan`.
- `tiny_config(name)`: that config at a few dozen dimensions (only keys the config has).
- `check_family(lab, name)`: one row for docs/MODELS.md: styles, both verdicts, and the
  collectives one decoder layer issues forward and backward (from `tplab.trace`).
"""

from __future__ import annotations

import functools

import torch

from tplab import hf
from tplab.checks.grad import grad_check
from tplab.lab.contract import Ranks
from tplab.rank.hf_step import layer_counts, logits_loss

# small sizes every family understands; only keys a config already has are set
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": 64, "max_position_embeddings": 64, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "num_experts": 4, "num_local_experts": 4,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "first_k_dense_replace": 0, "sliding_window": 16, "rotary_dim": 4,
        "use_cache": False, "tie_word_embeddings": False}
SEQ, BATCH = 8, 2
DEFAULT_FAMILIES = ("llama", "qwen3", "gemma3_text", "mixtral", "qwen3_moe")


def decoder_families() -> list[str]:
    """Model types with a causal-LM class whose default config has a base_model_tp_plan."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = []
    for name in CONFIG_MAPPING:
        if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            cfg = CONFIG_MAPPING[name]()
        except Exception:
            continue
        if getattr(cfg, "base_model_tp_plan", None):
            names.append(name)
    return names


def tiny_config(name: str, **overrides):
    """The config of model type `name` at the `TINY` sizes (and `overrides`)."""
    from transformers import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        raise ValueError(f"name: {name!r} is not a transformers model type")
    defaults = CONFIG_MAPPING[name]()
    kwargs = {k: v for k, v in TINY.items() if hasattr(defaults, k)}
    if hasattr(defaults, "qk_rope_head_dim"):  # MLA: the head dim is the RoPE part's,
        kwargs.pop("head_dim", None)             # and every query head has its own KV head
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # in the tiny vocabulary
        if isinstance(getattr(defaults, key, None), int):
            kwargs[key] = 0
    kwargs |= overrides
    return CONFIG_MAPPING[name](**kwargs)


def build(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny causal LM of model type `name`, random weights from `seed`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides))
    return model.float()


MAX_PARAMS = 20_000_000  # a tiny model; beyond this the config ignored the tiny sizes


def meta_size(name: str, **overrides) -> int:
    """Parameters of `name`'s tiny model, counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides))
    return sum(p.numel() for p in model.parameters())


def tokens(name: str) -> dict:
    """A batch of in-range token ids for `name`'s tiny config."""
    vocab = tiny_config(name).vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids}


def _short(counts: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def check_family(lab: Ranks, name: str, trace_layer: bool = True) -> dict:
    """Check model type `name` on `lab` both ways. A row: family, styles, `own` and
    `from_hf` verdicts ("ok", "WRONG: ...", or "cannot run: ..."), and the layer's
    collectives under transformers' own plan; `buildable` False with the reason when the
    tiny model cannot be built."""
    row = {"family": name, "buildable": True, "reason": ""}
    try:
        size = meta_size(name)
        if size > MAX_PARAMS:
            return row | {"buildable": False, "reason": f"{size / 1e6:.0f}M parameters at the "
                          "tiny sizes (a nested sub-config keeps its full default sizes)"}
        model = build(name)
        plan = dict(model.tp_plan)
        logits_loss(model(**tokens(name)))  # the single-device model itself must run
    except Exception as e:
        return row | {"buildable": False, "reason": f"{type(e).__name__}: {e}".split("\n")[0]}
    row["styles"] = sorted(set(plan.values()))
    builder = functools.partial(build, name)
    make = functools.partial(tokens, name)
    for label, get_plan in (("own", lambda: hf.apply_transformers_plan),
                            ("from_hf", lambda: hf.from_hf(model))):
        try:
            report = grad_check(lab, builder, get_plan(), make, loss_fn=logits_loss)
            row[label] = "ok" if report.ok else f"WRONG: {report.summary().split(': ', 2)[-1]}"
        except Exception as e:
            row[label] = f"cannot run: {type(e).__name__}: {str(e).strip().splitlines()[-1]}"
    if trace_layer and row["own"] == "ok":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        counts = lab.run(layer_counts, builder, state, hf.apply_transformers_plan,
                         make())[0]
        row["forward"], row["backward"] = (_short(counts.get("forward", {})),
                                           _short(counts.get("backward", {})))
    return row
