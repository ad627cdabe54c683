"""The native tiering policy: device pool -> host memory -> disk.

- Saves: a block is saved the first time it leaves the device's reach, i.e. when a
  cached block is evicted from the device pool or when a finished request releases it
  (write-through, so that a block survives in the lower tiers even if the device pool
  never evicts it before a restart). A block already in a tier, or queued, is not saved
  again: one device-to-host copy per block. Every saved block goes into the host tier (LRU, bounded) and, when a
  disk tier is configured, is also written to disk in the background: the disk tier is
  inclusive, so host-tier eviction just drops the block.
- Lookups at admission walk the request's block hashes after the device hit: host tier,
  then blocks queued for saving this step, then disk; the first miss ends the hit.
  Disk hits are read (and verified) synchronously at admission, which is on the step's
  critical path but only for the blocks the request needs; the time is counted in
  ``fetch_seconds``.
"""

from __future__ import annotations

import logging

from kvpilot.engine.block_hash import BlockHash
from kvpilot.engine.offload.base import OffloadBase, PendingBlock, Source
from kvpilot.engine.offload.block_io import BlockIO
from kvpilot.engine.offload.config import OffloadConfig
from kvpilot.engine.offload.disk_store import DiskStore
from kvpilot.engine.offload.host_store import HostStore
from kvpilot.engine.request import Request

logger = logging.getLogger(__name__)


class NativeOffload(OffloadBase):
    """Host-memory tier plus an optional disk tier, keyed by block hash.

    Args:
        config: sizes and disk path.
        block_size: tokens per block.
        block_io: copies blocks in and out of the device cache.
        layout_id: 8 bytes naming the KV layout, stamped into disk files.
    """

    def __init__(self, config: OffloadConfig, block_size: int, block_io: BlockIO,
                 layout_id: bytes) -> None:
        super().__init__(block_size, block_io)
        bpb = block_io.bytes_per_block
        self.host = HostStore(config.cpu_bytes, bpb)
        self.disk = (DiskStore(config.disk_path, config.disk_bytes, bpb, layout_id)
                     if config.disk_path is not None else None)
        self._saves: dict[BlockHash, PendingBlock] = {}   # queued, in order
        logger.info("KV offload (native): CPU tier %.2f GiB (%d blocks of %d KiB)%s",
                    config.cpu_gib, self.host.capacity_blocks, bpb // 1024,
                    f", disk tier {config.disk_gib:.2f} GiB at {config.disk_path}"
                    if self.disk is not None else "")

    # ---- lookups ------------------------------------------------------------
    def _fetch(self, request: Request, start_block: int, max_blocks: int) -> list[Source]:
        sources: list[Source] = []
        for block_hash in request.block_hashes[start_block:start_block + max_blocks]:
            source: Source | None = self.host.get(block_hash)
            if source is None:
                source = self._saves.get(block_hash)
            if source is None and self.disk is not None:
                found = self.disk.read(block_hash)
                if found is not None:
                    source = found[0]
            if source is None:
                break
            sources.append(source)
        return sources

    # ---- saves --------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self._queue_save(block_id, block_hash)

    def _queue_finished(self, request: Request, block_ids: list[int]) -> None:
        for block_id, block_hash in zip(block_ids, request.block_hashes, strict=False):
            self._queue_save(block_id, block_hash)

    def _queue_save(self, block_id: int, block_hash: BlockHash) -> None:
        if (block_hash in self._saves or block_hash in self.host
                or (self.disk is not None and block_hash in self.disk)):
            return
        self._saves[block_hash] = PendingBlock(block_id, block_hash)

    def _run_saves(self) -> None:
        if not self._saves:
            return
        pending = list(self._saves.values())
        self._saves.clear()
        payloads, ready = self.block_io.gather([p.block_id for p in pending])
        self.counters.gpu_to_cpu += len(pending) * self.block_io.bytes_per_block
        for block, payload in zip(pending, payloads, strict=True):
            block.payload = payload
            self.host.put(block.block_hash, payload)
            if self.disk is not None:
                self.disk.submit(block.block_hash, payload, ready)

    # ---- lifecycle / stats --------------------------------------------------------
    def flush(self) -> None:
        self._run_saves()
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        self._run_saves()
        if self.disk is not None:
            self.disk.close()

    def _tier_stats(self) -> dict[str, int | None]:
        figures: dict[str, int | None] = {"cpu_used": self.host.used_bytes,
                                          "cpu_capacity": self.host.capacity_bytes}
        if self.disk is not None:
            figures.update(disk_used=self.disk.used_bytes, disk_capacity=self.disk.capacity_bytes,
                           cpu_to_disk=self.disk.bytes_written, disk_to_cpu=self.disk.bytes_read)
        return figures
