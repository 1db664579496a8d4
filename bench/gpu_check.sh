#!/usr/bin/env bash
# GPU check for a machine with CUDA (torch, transformers and triton preinstalled, no internet).
# Runs the Triton kernel against the torch reference, reports its bandwidth, then one 64K-token
# session per cache arm. Budget: under 8 minutes. Usage: bash bench/gpu_check.sh [--session-tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'gpu_check needs CUDA'"
timeout 470 python bench/gpu_check.py "$@"
