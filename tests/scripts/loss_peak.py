"""Bytes per logit torchtitan's loss holds at its backward's peak, measured on this CPU
build: plain `cross_entropy` (ATen's fused log_softmax backward) and under torch's
`loss_parallel` on a one-rank mesh (torch/distributed/tensor/parallel/loss.py).

torchtitan's `loss_fn` (train.py at 9dec370) runs `cross_entropy(pred.flatten(0, 1).float(),
...)`, then `del pred` and `loss.backward()`. What is measured: log_softmax's saved fp32
output (what the forward leaves) plus the backward's rise of the peak resident set. Large
tensors are mmap'd by glibc, so the resident set follows them; writing 5 to
/proc/self/clear_refs resets the peak (VmHWM).

tests/test_cost_memory_runs.py calls `measure` in its own process when no process group
of more than one rank is up there, else runs this file (`main`), which prints
`plain <bytes> parallel <bytes>`."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel


def _resident(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _resident("VmRSS")


def loss_peak_per_logit(mesh, tokens: int = 2048, vocab: int = 8192) -> float:
    """Bytes per logit at the backward's peak: plain (`mesh` None) or vocab-parallel."""
    pred = torch.randn(tokens, vocab, dtype=torch.bfloat16)
    if mesh is not None:
        pred = distribute_tensor(pred, mesh, [Shard(1)])
    pred.requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    with loss_parallel() if mesh is not None else torch.enable_grad():
        before = _reset_peak()
        loss = F.cross_entropy(pred.float(), target)
        held = _resident("VmRSS") - before
        base = _reset_peak()
        loss.backward()
        return (held + _resident("VmHWM") - base) / (tokens * vocab)


def measure() -> tuple[float, float]:
    """(plain, loss_parallel) bytes per logit; uses a one-rank group already up in this
    process (an all-reduce over one rank is the identity), else makes one. A ValueError
    if a group of more ranks is up."""
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if dist.get_world_size() != 1:
            raise ValueError(f"a {dist.get_world_size()}-rank process group is up")
        return (loss_peak_per_logit(None),
                loss_peak_per_logit(init_device_mesh("cpu", (1,))))
    finally:
        if ours:
            dist.destroy_process_group()


def main() -> None:
    plain, parallel = measure()
    print(f"plain {plain:.3f} parallel {parallel:.3f}")


if __name__ == "__main__":
    sys.exit(main())
