"""KV offload through LMCache: its CPU, disk and remote (``lmcache server``) tiers.

Configuration is LMCache's own: a file named by ``LMCACHE_CONFIG_FILE`` and/or
``LMCACHE_*`` variables (``LMCACHE_CHUNK_SIZE``, ``LMCACHE_LOCAL_CPU``,
``LMCACHE_REMOTE_URL=lm://host:port``, ``LMCACHE_REMOTE_SERDE`` ...). The engine flags
override three of its keys: ``--kv-offloading-size`` -> ``max_local_cpu_size``,
``--kv-offloading-disk-path`` -> ``local_disk``, ``--kv-offloading-disk-size`` ->
``max_local_disk_size``. Usage tracking is turned off (``LMCACHE_TRACK_USAGE=false``)
and LMCache logs at WARNING (``LMCACHE_LOG_LEVEL``) unless those are set already.

Policy: a finished request's computed whole chunks are stored (after a lookup, so
chunks LMCache already holds are not sent again); device evictions are not saved
separately. At admission the chunks after the device hit are looked up and retrieved
into host memory right away, so the hit granted is exactly what arrived. Hits are
chunk-granular (``chunk_size`` tokens, 256 by default): a prefix reuses the chunks it
fully covers. Every chunk read back is checked against the digest it was stored with
(``lmcache_adapter``): a corrupt one is a miss from there on, removed from LMCache and
counted. The device copies go through the engine's ``BlockIO`` like the native
backend's. LMCache's engine forces multiprocessing's start method to ``spawn``; the
adapter restores the process's own setting (it starts no LMCache worker processes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.kv_transfer import KVTransfers
from kvpilot.engine.core.request import Request
from kvpilot.engine.offload.base import OffloadBase, Source
from kvpilot.engine.offload.block_io import BlockIO
from kvpilot.engine.offload.config import OffloadConfig

logger = logging.getLogger(__name__)


def _import_adapter():
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        from kvpilot.engine.offload import lmcache_adapter
    except ImportError as exc:
        raise ImportError(
            f"kv_offloading_backend='lmcache' needs the lmcache package ({exc}); install it "
            "with: pip install 'kvpilot[lmcache]'") from exc
    return lmcache_adapter


@dataclass(slots=True)
class _StoreJob:
    token_ids: list[int]      # whole chunks of a finished request
    cache_salt: str | None
    block_ids: list[int]
    block_hashes: list[BlockHash]   # of those blocks: each chunk's digest binds its key


class LMCacheOffload(OffloadBase):
    """Offload into an ``LMCacheEngine``.

    Args:
        config: CPU size and disk tier (overriding LMCache's config).
        block_size: tokens per block.
        block_io: copies blocks in and out of the device cache.
        hash_root: the engine's block-hash chain root (LMCache keys derive from it).
        layer_shape: (num_kv_heads, head_dim) of every layer.
        layer_dtypes: KV dtype of each layer (one dtype for all layers is required).
    """

    def __init__(self, config: OffloadConfig, block_size: int, block_io: BlockIO,
                 hash_root: BlockHash, layer_shape: tuple[int, int], layer_dtypes: list[torch.dtype]
                 ) -> None:
        if len(set(layer_dtypes)) != 1:
            raise ValueError("the lmcache offload backend needs one KV dtype for all layers "
                             "(turn off kv_cache_dtype_skip_sliding_window)")
        super().__init__(block_size, block_io)
        adapter = _import_adapter()
        num_kv_heads, head_dim = layer_shape
        self.engine = adapter.create_lmcache_engine(
            config, block_size=block_size, hash_root=hash_root, num_layers=len(layer_dtypes),
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=layer_dtypes[0])
        self.chunk_size: int = self.engine.metadata.chunk_size
        self._salt_key = adapter.SALT_KEY
        self._cpu_capacity = config.cpu_bytes
        self._closed = False

    def _request_configs(self, cache_salt: str | None) -> dict | None:
        return {self._salt_key: cache_salt} if cache_salt else None

    # ---- lookups ------------------------------------------------------------
    def _fetch(self, request: Request, start_block: int, max_blocks: int,
               pending_saves: Mapping[BlockHash, int]) -> list[Source]:
        bs, chunk = self.block_size, self.chunk_size
        start = start_block * bs
        end = (start_block + max_blocks) * bs // chunk * chunk     # whole chunks only
        if end <= start:
            return []
        token_ids = request.token_ids_slice(0, end)
        configs = self._request_configs(request.cache_salt)
        hit = self.engine.lookup(tokens=token_ids, request_configs=configs)
        if hit <= start:
            return []
        mask = torch.zeros(hit, dtype=torch.bool)
        mask[start // chunk * chunk:] = True
        fetched: dict[int, torch.Tensor] = {}
        corrupt: list[int] = []
        self.engine.retrieve(token_ids[:hit], mask=mask, fetched=fetched, request_configs=configs,
                             block_hashes=request.block_hashes, corrupt=corrupt)
        if corrupt:  # drop the bad chunks (and the prefix keyed with them): the finished request stores them anew
            self.engine.clear(tokens=token_ids[:max(corrupt) + chunk], request_configs=configs)
        sources: list[Source] = []
        for block in range(start_block, hit // bs):
            payload = fetched.get(block)
            if payload is None:
                break
            sources.append(payload)
        return sources

    # ---- saves --------------------------------------------------------------
    def _run_saves(self, transfers: KVTransfers) -> None:
        # Device evictions are not saved separately (a finished request's chunks are).
        for finished in transfers.finished:
            num_tokens = len(finished.block_ids) * self.block_size // self.chunk_size * self.chunk_size
            if not num_tokens:
                continue
            num_blocks = num_tokens // self.block_size
            job = _StoreJob(finished.token_ids[:num_tokens], finished.cache_salt,
                            finished.block_ids[:num_blocks], finished.block_hashes[:num_blocks])
            try:
                self._store(job)
            except Exception as exc:  # noqa: BLE001 - a failed store only loses a cache entry
                logger.warning("LMCache store failed (%s: %s); the blocks are not offloaded",
                               type(exc).__name__, exc)

    def _store(self, job: _StoreJob) -> None:
        """Stores the chunks of a finished request that LMCache does not hold yet."""
        configs = self._request_configs(job.cache_salt)
        stored = self.engine.lookup(tokens=job.token_ids, request_configs=configs)
        if stored >= len(job.token_ids):
            return
        first = stored // self.block_size
        payloads, ready = self.block_io.gather(job.block_ids[first:])
        if ready is not None:
            ready.synchronize()          # LMCache copies from host memory right away
        self.counters.gpu_to_cpu += len(payloads) * self.block_io.bytes_per_block
        mask = torch.zeros(len(job.token_ids), dtype=torch.bool)
        mask[stored:] = True
        self.engine.store(tokens=job.token_ids, mask=mask, request_configs=configs,
                          payloads={first + i: p for i, p in enumerate(payloads)},
                          block_hashes=job.block_hashes)

    # ---- lifecycle / stats --------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> None:
        """Runs queued stores and waits (up to ``timeout`` s) until LMCache's disk and
        remote backends have written them: their puts are asynchronous, and a process
        that exits earlier loses them."""
        deadline = time.monotonic() + timeout
        while self._num_pending_puts() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _num_pending_puts(self) -> int:
        # LMCache keeps the keys being written per backend (its internals: read defensively).
        pending = 0
        for backend in getattr(self.engine.storage_manager, "storage_backends", {}).values():
            worker = getattr(backend, "disk_worker", backend)
            pending += len(getattr(worker, "put_tasks", ()))
        return pending

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._closed = True
            self.engine.close()

    def _tier_stats(self) -> dict[str, int | None]:
        # Read from LMCache's backends (its internals, hence defensively): what the
        # host tier and the local disk tier hold. Remote tiers are not counted.
        backends = getattr(self.engine.storage_manager, "storage_backends", {})
        figures: dict[str, int | None] = {"cpu_capacity": self._cpu_capacity,
                                          "corrupt": self.engine.gpu_connector.num_corrupt}
        cpu = backends.get("LocalCPUBackend")
        if cpu is not None and hasattr(cpu, "hot_cache"):
            figures["cpu_used"] = sum(obj.get_size() for obj in list(cpu.hot_cache.values()))
        disk = backends.get("LocalDiskBackend")
        if disk is not None and hasattr(disk, "current_cache_size"):
            figures["disk_used"] = int(disk.current_cache_size)
            figures["disk_capacity"] = int(getattr(disk, "max_cache_size", 0)) or None
        return figures
