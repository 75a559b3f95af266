"""tplab.memory under activation checkpointing, byte for byte, under TP and SP.

A TinyLM whose blocks are checkpointed keeps only each block's input for backward: the
whole hidden state (b, s, d) per rank under TP, its sequence shard (b, s/t, d) under SP
(Korthikanti et al.'s full recomputation, 2sbh in bf16, sbh/t with SP). Backward runs each
block's forward again and saves the rest for a moment. The truths, per rank:

- each checkpointed block's row is its input's bytes, from the shapes alone;
- what the forward keeps equals an independent count of the storages the same forward
  saves (a bare `saved_tensors_hooks` pair in this file, parameters left out);
- kept plus recomputed equals that independent count of the model without checkpointing
  (every storage is saved once, in forward or in the recomputation), and module by module
  the recomputation saves what the plain model's blocks save, less the blocks' inputs;
- the reentrant checkpoint gives the same numbers, and the gradients are the plain model's.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tplab
from tplab import models

CFG = models.Config(dim=32, hidden_dim=64, n_layers=2, seq_len=8, batch_size=2)
CASES = [("megatron", False), ("megatron", True), ("dtensor", False), ("dtensor", True)]


def independent_count(step, model) -> int:
    """Bytes of the distinct non-parameter storages saved while `step()` runs its forward
    pass, counted by a bare pair of saved-tensor hooks (no tplab code)."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    def local(t):   # the plain tensor under a DTensor or a not yet waited-on collective
        while isinstance(t, (DTensor, AsyncCollectiveTensor)):
            t = t.to_local() if isinstance(t, DTensor) else t.wait()
        return t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if torch._C._current_graph_task_id() == -1:   # forward, not backward
            storage = local(t).untyped_storage()
            if storage.data_ptr() not in params and storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def measured(cases, cfg, independent):
    """Rank side: for each (plan, sp), the plain TinyLM and the same one checkpointed per
    Block (non-reentrant and reentrant), measured by tplab.memory and, in processes, by
    `independent_count`."""
    import functools

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    import tplab
    from tplab import checkpointing, megatron, models, plans

    mesh = tplab.make_mesh(tp=torch.distributed.get_world_size())
    tokens = models.make_tokens(cfg)
    out = {}
    for plan, sp in cases:
        def build(impl=None, plan=plan, sp=sp):
            model = models.TinyLM(cfg)
            if plan == "megatron":
                model = megatron.parallelize(model, mesh, sequence_parallel=sp)
            else:
                model = tplab.apply_plan(model, mesh, plans.lm(sp, loss_parallel=False))
            if impl is not None:
                checkpointing.checkpoint_blocks(model, ("Block",), impl=impl)
            return model

        def step(model):
            models.lm_loss(model(tokens), tokens).backward()
            return {n.replace("._checkpoint_wrapped_module", ""): p.grad
                    for n, p in model.named_parameters()}

        got = {}
        for name, impl in (("plain", None), ("checkpointed", CheckpointImpl.NO_REENTRANT),
                           ("reentrant", CheckpointImpl.REENTRANT)):
            model = build(impl)
            with tplab.memory() as m:
                grads = step(model)
            got[name] = m.summary()
            got[name]["grads_equal"] = name == "plain" or all(
                torch.equal(g, got["plain_grads"][n]) for n, g in grads.items())
            if name == "plain":
                got["plain_grads"] = grads
            if independent:
                model = build(impl)
                got[name]["independent"] = independent_count(functools.partial(step, model),
                                                             model)
        del got["plain_grads"]
        out[(plan, sp)] = got
    return out


def _strip(rows):
    return {r["module"].replace("._checkpoint_wrapped_module", ""): r["bytes"] for r in rows}


def check(per_rank, cfg, tp, independent):
    for case in CASES:
        sp = case[1]
        block_input = cfg.batch_size * cfg.seq_len * cfg.dim * 4 // (tp if sp else 1)
        for rank, got in enumerate(per_rank):
            plain, ck = got[case]["plain"], got[case]["checkpointed"]
            where = (case, rank)
            rows = _strip(ck["rows"])
            blocks = [f"layers.{i}" for i in range(cfg.n_layers)]
            assert [rows[b] for b in blocks] == [block_input] * cfg.n_layers, where
            assert ck["activation_bytes"] < plain["activation_bytes"], where
            # every storage the plain forward saves is kept or recomputed, once
            total = ck["activation_bytes"] + ck["recomputed_bytes"]
            assert total == plain["activation_bytes"], where
            # module by module, the recomputation saves what the plain blocks save, except
            # the blocks' inputs (kept already): those are the first rows of each block
            plain_rows, again = _strip(plain["rows"]), _strip(ck["recomputed_rows"])
            inside = {k: v for k, v in plain_rows.items() if k.startswith("layers.")}
            assert sum(inside.values()) - cfg.n_layers * block_input == sum(again.values())
            assert all(again[k] <= v for k, v in inside.items() if k in again), where
            assert plain["recomputed_bytes"] == 0 and not plain["recomputed_rows"], where
            # the peak: the last block's recomputation, while every block input and the
            # embedding's saved tokens are alive, and nothing else (in rank processes too)
            one_block = sum(again.values()) // cfg.n_layers
            expected_peak = rows["tok_embeddings"] + cfg.n_layers * block_input + one_block
            assert ck["peak_bytes"] == expected_peak < plain["peak_bytes"], where
            assert ck["grads_equal"] and got[case]["reentrant"]["grads_equal"], where
            same = ("activation_bytes", "recomputed_bytes")
            reentrant = got[case]["reentrant"]
            assert [reentrant[k] for k in same] == [ck[k] for k in same], where
            assert reentrant["peak_bytes"] == expected_peak, where
            if independent:
                assert plain["independent"] == plain["activation_bytes"], where
                assert ck["independent"] == ck["activation_bytes"], where
                assert reentrant["independent"] == ck["activation_bytes"], where


@pytest.mark.parametrize("tp", [2])
def test_checkpointed_blocks_keep_their_inputs_simulated(tp):
    check(tplab.simulate(tp).run(measured, CASES, CFG, False), CFG, tp, False)


@pytest.mark.slow
def test_checkpointed_blocks_keep_their_inputs_on_processes(labs):
    check(labs.get(4).run(measured, CASES, CFG, True), CFG, 4, True)


def test_a_recomputation_in_another_thread_is_counted():
    """On CUDA autograd runs backward on a device thread of its own, not the caller's; a
    checkpoint's recomputation saves its tensors there (seen on an H200: recomputed 0, where
    CPU gave the whole block). Backward started from another thread is the same case on CPU:
    the numbers must be those of a backward on the thread that opened the context."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def step(in_thread: bool):
        with tplab.memory(block) as m:
            loss = checkpoint(block, x, use_reentrant=False).square().sum()
            if in_thread:
                t = threading.Thread(target=loss.backward)
                t.start()
                t.join()
            else:
                loss.backward()
        return m.summary()

    here, there = step(False), step(True)
    assert here["recomputed_bytes"] > 0 and here["peak_bytes"] > here["activation_bytes"]
    assert {k: there[k] for k in ("recomputed_bytes", "peak_bytes", "activation_bytes")} \
        == {k: here[k] for k in ("recomputed_bytes", "peak_bytes", "activation_bytes")}
