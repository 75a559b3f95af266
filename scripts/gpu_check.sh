#!/usr/bin/env bash
# The GPU path, on a machine with NVIDIA GPUs: backend="auto", a traced NCCL TP step,
# ranks sharing one GPU through gloo, grad_check on CUDA, and (2+ GPUs) a lab step against
# torchrun. Runs benchmarks/gpu.py in the project's venv; under 5 minutes. Without a GPU
# it says so and exits 0.
#   scripts/gpu_check.sh [--steps 20]
# The venv needs a CUDA build of torch 2.13.0 (the CPU wheel sees no GPU):
#   TPLAB_VENV=.venv-gpu scripts/env.sh python -m pip install torch==2.13.0
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
else
  echo "[gpu_check] nvidia-smi not found: no NVIDIA driver on this machine"
fi
exec timeout 300 scripts/env.sh python benchmarks/gpu.py "$@"
