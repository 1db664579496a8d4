#!/usr/bin/env bash
# GPU check for a machine with CUDA (torch, transformers and triton preinstalled, no internet).
# Kernels against their torch references, re-rotation bandwidth, fused attention + column sums
# against SDPA, then a Qwen3-8B-shaped PACE session of up to 1M tokens (it stops at a deadline,
# --deadline seconds after start, and says so). Budget: under 4 minutes; the table comes last.
# Usage: bash bench/gpu_check.sh [--session-tokens N] [--dynamic-tokens N] [--layers N] [--deadline S]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'gpu_check needs CUDA'"
timeout 230 python bench/gpu_check.py "$@"
