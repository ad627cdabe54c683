"""KV offload: the prefix cache extended into host memory, disk, or LMCache.

``create_kv_offload`` builds the backend; the scheduler calls its lookup half and the
runner its executor half (see ``base.py`` for the protocol and its invariants); the engine
holds ``None`` instead when offload is off, so that path is unchanged. ``OffloadConfig``
is torch-free.

May import: torch, ``kvpilot.engine.core``, and LMCache (only in its backend).
"""

from __future__ import annotations

import hashlib

from kvpilot.engine.offload.config import OFFLOAD_BACKENDS, OffloadConfig

__all__ = ["OFFLOAD_BACKENDS", "OffloadConfig", "create_kv_offload"]


def create_kv_offload(config: OffloadConfig, *, kv_caches, block_size: int, hash_root: bytes):
    """The offload strategy for a runner's allocated KV cache.

    Args:
        config: backend, sizes, disk tier.
        kv_caches: the runner's KV cache (one tensor or per-layer views).
        block_size: tokens per block.
        hash_root: the engine's block-hash chain root (model, KV dtype, block size, seed).
    """
    from kvpilot.engine.offload.block_io import BlockIO

    layers = list(kv_caches) if isinstance(kv_caches, list) else list(kv_caches.unbind(0))
    block_io = BlockIO(kv_caches)
    if config.backend == "lmcache":
        from kvpilot.engine.offload.lmcache_backend import LMCacheOffload

        shape = tuple(layers[0].shape)   # [2, num_blocks, block_size, kv_heads, head_dim]
        if any(tuple(layer.shape) != shape for layer in layers):
            raise ValueError("the lmcache offload backend needs the same KV shape in every layer")
        return LMCacheOffload(config, block_size, block_io, hash_root, (shape[3], shape[4]),
                              [layer.dtype for layer in layers])
    from kvpilot.engine.offload.manager import NativeOffload

    # Everything that changes a payload's bytes besides the block's tokens.
    layout = ";".join(f"{layer.dtype}:{tuple(layer.shape[2:])}" for layer in layers)
    layout_id = hashlib.sha256(hash_root + layout.encode()).digest()[:8]
    return NativeOffload(config, block_size, block_io, layout_id)
