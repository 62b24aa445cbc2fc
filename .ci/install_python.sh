#!/usr/bin/env bash
# Python packages. A torch that is already installed (say a CUDA build) is kept. With none, a machine with an
# NVIDIA driver gets the registry's default (CUDA) build, and a CPU-only machine gets the CPU build of torch 2.13.0.
# Then everything in requirements.txt, whose torch range the installed torch satisfies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if $PY -c "import torch" 2>/dev/null; then
  echo "[install_python] keeping torch $($PY -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1; then
  $PY -m pip install -q torch
else
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -r requirements.txt
echo "[install_python] done: torch $($PY -c 'import torch; print(torch.__version__)')"
