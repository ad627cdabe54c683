"""Triton kernels for the paged KV cache: KV store and unified paged attention.

Names are resolved lazily so that importing ``kvpilot.kernels`` (or running
``python -m kvpilot.kernels.bench_gpu``) does not import triton before the caller had a
chance to set ``TRITON_INTERPRET``.

- ``store_kv_cache`` / ``store_kv_cache_ref``: write new K/V into their cache slots
  (fp8 quantization with per-tensor scales).
- ``unified_attention`` / ``unified_attention_ref``: causal varlen attention over the
  paged cache (prefill, chunked prefill, decode; GQA; fp8 dequantization).
- ``kvpilot.kernels.fp8``: fp8 dtypes, limits and the torch quantizer (no triton).
- ``kvpilot.kernels.paged_batch``: random varlen paged batches for tests and benchmarks.
- ``python -m kvpilot.kernels.bench_gpu``: compiled-kernel checks and timings on CUDA.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "store_kv_cache": "kvpilot.kernels.kv_store",
    "store_kv_cache_ref": "kvpilot.kernels.kv_store",
    "kv_store_kernel": "kvpilot.kernels.kv_store",
    "unified_attention": "kvpilot.kernels.unified_attention",
    "unified_attention_ref": "kvpilot.kernels.unified_attention",
    "unified_attention_kernel": "kvpilot.kernels.unified_attention",
    "AttentionTiling": "kvpilot.kernels.unified_attention",
    "default_tiling": "kvpilot.kernels.unified_attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
