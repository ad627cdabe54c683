#!/usr/bin/env bash
# One short run (under 8 minutes on one GPU) that measures the GPU path and writes one JSON:
# every Triton kernel compiled vs its reference; decode attention bandwidth as % of the
# measured copy bandwidth; engine vs HF transformers throughput on a random-weight
# Qwen3-0.6B-shaped model (batch 64, 512 in / 128 out); CUDA graphs on vs off; per-step
# overhead at batch 256. See kvpilot/engine/bench/gpu_check.py.
#   scripts/gpu-check.sh [OUT.json]      (default: gpu-check.json)
# Without a CUDA device it says so and exits 0; CI never runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1   # the repository's operator/ must not shadow the stdlib module
py="${PYTHON:-.venv/bin/python}"
out="${1:-gpu-check.json}"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: no CUDA device found (torch.cuda.is_available() is False); nothing was run." \
       "Run it on a machine with an NVIDIA GPU."
  exit 0
fi
exec timeout 480 "$py" -m kvpilot.engine.bench.gpu_check --json-out "$out"
