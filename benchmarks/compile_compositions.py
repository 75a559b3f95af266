"""What a whole-model torch.compile composes with, in plain torch (tplab's own calls left out:
torch's parallelize_module, checkpoint_wrapper, torch.compile and fully_shard on 2 gloo
processes, CPU). The evidence behind `tplab.compiling.COMPOSITIONS` (issue 38 item 21).

    scripts/env.sh python benchmarks/compile_compositions.py

Two models: tplab.models.TinyLM (a plain nn.Module: RMSNorm weights, attention, the lesson
model) under the plan dict plans.lm(loss_parallel=False), and a norm-free MLP stack with
Colwise/Rowwise pairs. Prints RAN or FAILED (torch's exception) for each composition.
Measured here on torch 2.13.0: TP -> checkpoint_wrapper -> compile fails for TinyLM
("expected all tensors_saved_with_vc_check to be Tensors": a parameter saved for backward
inside the checkpointed region) and runs for the MLP stack; TP -> compile -> fully_shard per
block fails for both ("Mixing fake modes NYI").
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tplab import models, plans

CASES = ("checkpoint then compile", "compile then fully_shard per block")


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))  # (b, s, 16) -> (b, s, 32) -> (b, s, 16)


class MLPStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([MLPBlock(), MLPBlock()])
        self.output = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return self.output(x)


def build(name: str):
    """(model, its TP plan dict)."""
    if name == "TinyLM":
        cfg = models.Config(vocab_size=32, dim=16, n_layers=2, n_heads=4, hidden_dim=32,
                            seq_len=8, batch_size=4)
        return models.TinyLM(cfg), plans.lm(loss_parallel=False)
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
            "layers.*.w1": ColwiseParallel(), "layers.*.w2": RowwiseParallel()}
    return MLPStack(), plan


def compose(model, plan, mesh, case: str):
    model = parallelize_module(model, mesh["tp"], plan)
    if case == CASES[0]:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
        return torch.compile(model)
    compiled = torch.compile(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return compiled


def first_line(exc: Exception) -> str:
    """torch's own message, without dynamo's advice lines."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip() and "TORCHDYNAMO" not in ln
             and "TORCH_LOGS" not in ln and not ln.startswith("Set ")]
    return (lines[0] if lines else "")[:160]


def rank(r: int, port: int, name: str, case: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model, plan = build(name)
    try:
        compose(model, plan, mesh, case)(torch.randint(0, 32, (4, 8))).sum().backward()
        outcome = "RAN"
    except Exception as exc:  # what torch raised is the measurement
        outcome = f"FAILED: {type(exc).__name__}: {first_line(exc)}"
    if r == 0:
        queue.put(outcome)
    dist.destroy_process_group()


def main() -> int:
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}, 2 gloo processes, CPU, fresh processes per line")
    for k, (name, case) in enumerate((n, c) for n in ("TinyLM", "MLP stack") for c in CASES):
        queue = ctx.Queue()
        port = 29500 + (os.getpid() * 4 + k) % 2000
        mp.start_processes(rank, args=(port, name, case, queue), nprocs=2,
                           start_method="spawn")
        print(f"{name:10} {case:36} {queue.get()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
