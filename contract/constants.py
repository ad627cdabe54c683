"""Names and limits shared by the engine, its CLI and the operator: one source for each.

Torch-free and dependency-free on purpose: the operator (whose image has no torch) and
the engine both import these, so a value accepted by ``kvpilot serve`` is exactly one
the planner and the CRD accept. ``tests/test_shared_constants.py`` checks every side.
"""

from __future__ import annotations

# Compute dtypes a checkpoint can be served in (``--dtype``); ``auto`` follows the
# checkpoint (float32 on CPU).
MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")
MODEL_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

# KV cache dtypes (``--kv-cache-dtype``): ``auto`` follows the model dtype; ``fp8`` is e4m3.
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", *FP8_KV_DTYPES)

# Attention implementations (``--attention-backend``): auto = triton on CUDA, elsewhere cpu
# (decode rows on the compiled CPU kernel) where that kernel builds, else torch.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")

# KV offload backends (``--kv-offloading-backend``).
OFFLOAD_BACKENDS = ("native", "lmcache")

# Where the engine keeps the disk KV tier unless told otherwise (the operator mounts the
# tier's volume here).
DEFAULT_OFFLOAD_DISK_PATH = "/var/cache/kvpilot/kv"

# GPUs per model replica (``--tensor-parallel-size``): tensor parallelism within one node
# (one pod); the CRD's gpu.count has the same ceiling. Multi-node replicas are out of scope.
MAX_TENSOR_PARALLEL_SIZE = 8

# The server's probe routes, which the operator's Deployment probes: readiness (vLLM's
# /health: loading, draining, a dead or stalled engine are 503) and liveness (never
# waits on the engine).
READINESS_PATH = "/health"
LIVENESS_PATH = "/livez"
