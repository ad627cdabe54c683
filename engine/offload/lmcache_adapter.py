"""Glue between LMCache and the engine (imports lmcache: load only when it is chosen).

- ``BlockHashTokenDatabase``: LMCache turns token ids into chunk keys through a token
  database. This one keys a chunk by kvpilot's own sha256 block-hash chain (the hash
  of the chunk's last block, folded to 64 bits as LMCache does with vLLM's sha256
  hashes): its root covers the hash seed, the model fingerprint, KV dtype and block
  size, and the first block carries the request's ``cache_salt``. So keys are the same
  in every process and after restarts without any ``PYTHONHASHSEED`` agreement, and
  LMCache never serves KV of another model, layout or tenant. Only whole chunks are
  keyed (LMCache's ``save_unfull_chunk=False`` behaviour).
- ``BlockPayloadConnector``: LMCache's "GPU connector" moves chunks between its memory
  objects (``[2, layers, tokens, kv_heads * head_dim]``, LMCache's KV_2LTD format) and
  the engine. Here it converts to and from the engine's per-block host payloads; the
  device copies are done by the engine (``BlockIO``), like for the native backend.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable

import torch
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import load_engine_config_with_overrides
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.token_database import TokenDatabase

from kvpilot.engine.core.block_hash import BlockHash, extend_block_hashes
from kvpilot.engine.offload.config import OffloadConfig

SALT_KEY = "kvpilot.cache_salt"   # request_configs entry carrying the cache salt
# LMCache features that change how chunks map to the KV cache; this adapter does not do them.
UNSUPPORTED_FLAGS = ("use_layerwise", "enable_blending", "enable_pd", "save_unfull_chunk")


class BlockHashTokenDatabase(TokenDatabase):
    """Chunk keys from kvpilot's block-hash chain.

    Args:
        metadata: LMCache metadata (model name, dtype: part of every key).
        chunk_size: tokens per LMCache chunk, a multiple of ``block_size``.
        block_size: the engine's tokens per block.
        hash_root: the engine's hash-chain root.
    """

    def __init__(self, metadata: LMCacheMetadata, chunk_size: int, block_size: int,
                 hash_root: BlockHash) -> None:
        # TokenDatabase.__init__ only picks a token hash function (and warns about
        # PYTHONHASHSEED); this database does not hash tokens with it, so it is skipped.
        self.metadata = metadata
        self.save_only_first_rank = False
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.hash_root = hash_root

    def process_tokens(self, tokens=None, hashes=None, offsets=None, mask=None, make_key=True,
                       request_configs=None) -> Iterable[tuple[int, int, object]]:
        if tokens is None:
            raise ValueError("kvpilot's LMCache token database keys chunks by token ids only")
        token_ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        skip = 0 if mask is None else int(mask.numel() - int(mask.sum()))
        if skip % self.chunk_size:
            raise ValueError("the number of Falses in the mask is not a multiple of the chunk size")
        salt = (request_configs or {}).get(SALT_KEY)
        num_chunks = len(token_ids) // self.chunk_size
        block_hashes: list[BlockHash] = []
        extend_block_hashes(block_hashes, token_ids[:num_chunks * self.chunk_size],
                            self.block_size, self.hash_root, salt)
        per_chunk = self.chunk_size // self.block_size
        for chunk in range(skip // self.chunk_size, num_chunks):
            start = chunk * self.chunk_size
            chunk_hash = int.from_bytes(block_hashes[(chunk + 1) * per_chunk - 1][:8], "big")
            key = self._make_key_by_hash(chunk_hash, request_configs) if make_key else chunk_hash
            yield start, start + self.chunk_size, key


class BlockPayloadConnector(GPUConnectorInterface):
    """Chunk memory objects <-> per-block payloads (flat uint8 host tensors).

    ``from_gpu`` (store) reads ``kwargs["payloads"]``: absolute block index -> payload.
    ``to_gpu`` (retrieve) fills ``kwargs["fetched"]`` the same way.
    """

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.hidden = num_kv_heads * head_dim
        self.dtype = dtype
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])

    def _chunk_view(self, memory_obj, num_blocks: int) -> torch.Tensor:
        # [2, L, tokens, hidden] -> [blocks, L, 2, block_size, hidden] (the payload order)
        tensor = memory_obj.tensor.view(2, self.num_layers, num_blocks, self.block_size, self.hidden)
        return tensor.permute(2, 1, 0, 3, 4)

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        payloads: dict[int, torch.Tensor] = kwargs["payloads"]
        first, num = start // self.block_size, (end - start) // self.block_size
        src = torch.stack([payloads[first + i] for i in range(num)])
        src = src.view(self.dtype).view(num, self.num_layers, 2, self.block_size, self.hidden)
        self._chunk_view(memory_obj, num).copy_(src)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        fetched: dict[int, torch.Tensor] = kwargs["fetched"]
        first, num = start // self.block_size, (end - start) // self.block_size
        out = torch.empty((num, self.num_layers, 2, self.block_size, self.hidden), dtype=self.dtype)
        out.copy_(self._chunk_view(memory_obj, num))   # a copy: LMCache reuses its buffer
        for i, row in enumerate(out.view(num, -1).view(torch.uint8).unbind(0)):
            fetched[first + i] = row

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def create_lmcache_engine(config: OffloadConfig, *, block_size: int, hash_root: BlockHash,
                          num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> LMCacheEngine:
    """An LMCache engine configured from LMCACHE_CONFIG_FILE / LMCACHE_* variables, with
    the CPU size and the disk tier taken from ``config`` (the engine flags win)."""
    overrides: dict[str, object] = {"max_local_cpu_size": config.cpu_gib}
    if config.disk_path is not None:
        os.makedirs(config.disk_path, exist_ok=True)
        overrides.update(local_disk=config.disk_path, max_local_disk_size=config.disk_gib)
    lmc_config = load_engine_config_with_overrides(overrides=overrides)
    for flag in UNSUPPORTED_FLAGS:
        if getattr(lmc_config, flag, False):
            raise ValueError(f"LMCache's {flag} is not supported by kvpilot's LMCache backend; "
                             f"turn it off in the LMCache config")
    chunk_size = lmc_config.chunk_size
    if chunk_size < block_size or chunk_size % block_size:
        raise ValueError(f"LMCache chunk_size {chunk_size} must be a multiple of the engine's "
                         f"block_size {block_size} (set LMCACHE_CHUNK_SIZE or chunk_size in "
                         f"the LMCache config file)")
    metadata = LMCacheMetadata(
        model_name=f"kvpilot-{hash_root.hex()[:16]}", world_size=1, local_world_size=1,
        worker_id=0, local_worker_id=0, kv_dtype=dtype,
        kv_shape=(num_layers, 2, chunk_size, num_kv_heads, head_dim), chunk_size=chunk_size,
    )
    token_db = BlockHashTokenDatabase(metadata, chunk_size, block_size, hash_root)
    connector = BlockPayloadConnector(num_layers, block_size, num_kv_heads, head_dim, dtype)
    # Built directly rather than through LMCacheEngineBuilder, whose token database
    # hashes tokens with Python's hash(); post_init() creates the storage backends.
    # LMCacheEngine forces multiprocessing's start method to "spawn" for its controller
    # workers, which this adapter does not start: the process's own choice is restored.
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        engine = LMCacheEngine(lmc_config, metadata, token_db, connector, None, None)
    finally:
        multiprocessing.set_start_method(start_method, force=True)
    engine.post_init()
    return engine
