"""Triton kernels: KV store, paged attention (unified and split-KV), RMSNorm, rotary.

Names are resolved lazily so that importing ``kvpilot.kernels`` does not import triton
before the caller had a chance to set ``TRITON_INTERPRET``.

May import: torch, triton, numpy. Never ``kvpilot.engine`` or ``kvpilot.operator`` (the
engine builds on the kernels, not the other way round; ``tests/structure/test_layering.py``
checks it).

- ``store_kv_cache`` / ``store_kv_cache_ref``: write new K/V into their cache slots
  (fp8 quantization with per-tensor scales).
- ``unified_attention`` / ``unified_attention_ref``: causal varlen attention over the
  paged cache (prefill, chunked prefill, decode; GQA; fp8 dequantization); long-context
  decode with few sequences splits the keys across programs
  (``kvpilot.kernels.split_kv_attention``, chosen by ``choose_num_kv_splits``).
- ``rms_norm`` / ``rms_norm_ref``: RMSNorm, optionally fused with the residual add.
- ``rotary_embedding`` / ``rotary_embedding_ref``: rope ("rotate half"), in place.
- ``kvpilot.kernels.fp8``: fp8 dtypes, limits and the torch quantizer (no triton).
- ``kvpilot.kernels.attention_metadata``: ``AttentionMetadata``, the varlen batch the
  kernels and the engine's torch path read.
- ``kvpilot.kernels.paged_batch``: random varlen paged batches for tests and benchmarks.
- ``kvpilot.kernels.paged_decode_cpu``: decode attention on CPU, a C++ kernel (not Triton)
  built on first use with torch's cpp_extension; the engine's ``cpu`` attention backend.

Compiled-kernel checks and timings on CUDA live with the engine's benchmarks
(``python -m kvpilot.engine.bench.kernels_gpu``), since they also compare with the
engine's torch path.
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
    "choose_num_kv_splits": "kvpilot.kernels.split_kv_attention",
    "rms_norm": "kvpilot.kernels.rms_norm",
    "rms_norm_ref": "kvpilot.kernels.rms_norm",
    "rotary_embedding": "kvpilot.kernels.rotary",
    "rotary_embedding_ref": "kvpilot.kernels.rotary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
