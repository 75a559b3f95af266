#!/usr/bin/env bash
# The GPU path, on a machine with NVIDIA GPUs: backend="auto", a traced NCCL TP step,
# 2 and 4 ranks sharing one GPU through gloo, grad_check on CUDA, and (2+ GPUs) a lab step
# against torchrun; with --memory / --rates / --all (--json PATH) also tplab.memory against
# the CUDA allocator and the H200 preset's kernel rates. Runs benchmarks/gpu.py; the checks
# take under 5 minutes. Without a GPU it says so and exits 0.
#   scripts/gpu_check.sh [--steps 20] [--all] [--json PATH]
# In the project's venv (scripts/env.sh), which needs a CUDA build of torch (the CPU wheel
# sees no GPU):
#   TPLAB_VENV=.venv-gpu scripts/env.sh python -m pip install torch==2.13.0
# Or under a GPU machine's own Python and its torch (>= 2.10), with tplab's other
# requirements on PYTHONPATH (pip install --target DIR ...) and no venv made:
#   TPLAB_PYTHON=python3 PYTHONPATH=DIR scripts/gpu_check.sh --all
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
else
  echo "[gpu_check] nvidia-smi not found: no NVIDIA driver on this machine"
fi
limit=300
case " $* " in *" --all "*|*" --memory "*|*" --rates "*) limit=420 ;; esac
if [ -n "${TPLAB_PYTHON:-}" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  exec timeout "$limit" "$TPLAB_PYTHON" benchmarks/gpu.py "$@"
fi
exec timeout "$limit" scripts/env.sh python benchmarks/gpu.py "$@"
