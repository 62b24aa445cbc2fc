#!/usr/bin/env bash
# Python packages: what the scripts import (requirements.txt); with --dev also what the tests and CI's checks use
# (requirements-dev.txt). A torch that is already installed (say a CUDA build) is kept. With none, a machine with an
# NVIDIA driver gets the registry's default build (CUDA, on Linux), and a machine without one PyTorch's CPU build of
# torch 2.13.0 (2.13.0+cpu: from pip's local wheels where it has it, else from PyTorch's CPU index; PyPI's own Linux
# wheel of torch would be the CUDA build, gigabytes of CUDA libraries that a CPU cannot use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU="2.13.0+cpu"
requirements="requirements.txt"
if [ "${1:-}" = "--dev" ]; then requirements="requirements-dev.txt"; fi
if $PY -c "import torch" 2>/dev/null; then
  echo "[install_python] keeping torch $($PY -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1; then
  $PY -m pip install -q torch
elif $PY -m pip download -q --no-deps --no-index "torch==$TORCH_CPU" -d "$(mktemp -d)" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==$TORCH_CPU"
else
  $PY -m pip install -q "torch==$TORCH_CPU" --extra-index-url https://download.pytorch.org/whl/cpu
fi
$PY -m pip install -q -r "$requirements"
echo "[install_python] done ($requirements): torch $($PY -c 'import torch; print(torch.__version__)')"
