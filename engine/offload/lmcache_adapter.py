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
- Integrity: every chunk carries one token row more than its tokens
  (``DigestRowMetadata``), holding a blake2b-128 digest of the chunk's payload and of
  the block hash it is stored under. A chunk read back from any tier (CPU, disk, a remote
  ``lmcache server``) whose digest does not match (bit rot, a truncated file, another
  chunk's bytes under this key) is not used: its blocks are recomputed and it is counted
  (``num_corrupt``). The row costs 1/chunk_size of the space (0.4% at 256 tokens).
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from lmcache.v1.cache_engine import LMCacheEngine
from lmcache.v1.config import load_engine_config_with_overrides
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.token_database import TokenDatabase

from kvpilot.engine.core.block_hash import BlockHash, extend_block_hashes
from kvpilot.engine.offload.config import OffloadConfig

logger = logging.getLogger(__name__)

SALT_KEY = "kvpilot.cache_salt"   # request_configs entry carrying the cache salt
DIGEST_ROWS = 1                   # token rows added to each chunk for its digest
DIGEST_BYTES = 16
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


@dataclass
class DigestRowMetadata(LMCacheMetadata):
    """LMCache's metadata with ``DIGEST_ROWS`` more token rows in every chunk it allocates."""

    def get_shapes(self, num_tokens: int | None = None) -> list[torch.Size]:
        return super().get_shapes((self.chunk_size if num_tokens is None else num_tokens) + DIGEST_ROWS)


def chunk_digest(block_hash: bytes, payload: torch.Tensor) -> bytes:
    """The digest a chunk carries: of the block hash it is keyed by and of its payload bytes."""
    h = hashlib.blake2b(block_hash, digest_size=DIGEST_BYTES)
    h.update(memoryview(payload.contiguous().view(torch.uint8).reshape(-1).numpy()))
    return h.digest()


class BlockPayloadConnector(GPUConnectorInterface):
    """Chunk memory objects <-> per-block payloads (flat uint8 host tensors), digest checked.

    ``from_gpu`` (store) reads ``kwargs["payloads"]`` (absolute block index -> payload)
    and ``kwargs["block_hashes"]`` (the request's); ``to_gpu`` (retrieve) fills
    ``kwargs["fetched"]`` the same way, leaving out chunks whose digest does not match
    (their first token index goes to ``kwargs["corrupt"]``, a list).
    """

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.hidden = num_kv_heads * head_dim
        self.dtype = dtype
        self.kvcaches = None
        self.num_corrupt = 0
        if self.hidden * dtype.itemsize < DIGEST_BYTES:
            raise ValueError(f"a KV row of {self.hidden * dtype.itemsize} bytes cannot hold the chunk digest")

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens + DIGEST_ROWS, self.hidden])

    def _chunk_view(self, memory_obj, num_blocks: int) -> torch.Tensor:
        # [2, L, tokens (+ digest row), hidden] -> [blocks, L, 2, block_size, hidden] (the payload order)
        tokens = memory_obj.tensor[:, :, :num_blocks * self.block_size]
        tensor = tokens.view(2, self.num_layers, num_blocks, self.block_size, self.hidden)
        return tensor.permute(2, 1, 0, 3, 4)

    def _digest_row(self, memory_obj, num_blocks: int) -> torch.Tensor:
        return memory_obj.tensor[0, 0, num_blocks * self.block_size].view(torch.uint8)

    def _key(self, block_hashes: Sequence[bytes], end: int) -> bytes:
        last = end // self.block_size - 1
        return bytes(block_hashes[last]) if 0 <= last < len(block_hashes) else b""

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        payloads: dict[int, torch.Tensor] = kwargs["payloads"]
        first, num = start // self.block_size, (end - start) // self.block_size
        src = torch.stack([payloads[first + i] for i in range(num)])
        src = src.view(self.dtype).view(num, self.num_layers, 2, self.block_size, self.hidden)
        self._chunk_view(memory_obj, num).copy_(src)
        memory_obj.tensor[:, :, num * self.block_size:].zero_()
        digest = chunk_digest(self._key(kwargs.get("block_hashes") or (), end), src)
        self._digest_row(memory_obj, num)[:DIGEST_BYTES].copy_(torch.frombuffer(bytearray(digest), dtype=torch.uint8))

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        fetched: dict[int, torch.Tensor] = kwargs["fetched"]
        first, num = start // self.block_size, (end - start) // self.block_size
        out = torch.empty((num, self.num_layers, 2, self.block_size, self.hidden), dtype=self.dtype)
        out.copy_(self._chunk_view(memory_obj, num))   # a copy: LMCache reuses its buffer
        stored = bytes(self._digest_row(memory_obj, num)[:DIGEST_BYTES].tolist())
        if stored != chunk_digest(self._key(kwargs.get("block_hashes") or (), end), out):
            self.num_corrupt += 1
            if (corrupt := kwargs.get("corrupt")) is not None:
                corrupt.append(start)
            logger.warning("LMCache chunk of tokens %d..%d failed its integrity check; its blocks are "
                           "recomputed", start, end)
            return
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
    metadata = DigestRowMetadata(
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
