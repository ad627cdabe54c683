"""The native tiering policy: device pool -> host memory -> disk.

- Saves: a block is saved the first time it leaves the device's reach, i.e. when a
  cached block is evicted from the device pool or when a finished request releases it
  (write-through, so that a block survives in the lower tiers even if the device pool
  never evicts it before a restart). A block already in a tier, or listed twice, is not
  saved again: one device-to-host copy per block. Every saved block goes into the host tier (LRU, bounded) and, when a
  disk tier is configured, is also written to disk in the background: the disk tier is
  inclusive, so host-tier eviction just drops the block.
- Lookups at admission walk the request's block hashes after the device hit: host tier,
  then blocks listed for saving this step (their payload is filled in when the save
  runs, before any load), then disk; the first miss ends the hit.
  Disk hits are read (and verified) synchronously at admission, which is on the step's
  critical path but only for the blocks the request needs; the time is counted in
  ``fetch_seconds``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.kv_connector import DISK, HOST
from kvpilot.engine.core.kv_transfer import KVTransfers
from kvpilot.engine.core.request import Request
from kvpilot.engine.offload.base import Fetched, OffloadBase, PendingBlock, Source
from kvpilot.engine.offload.block_io import BlockIO
from kvpilot.engine.offload.config import OffloadConfig
from kvpilot.engine.offload.disk_store import DiskStore
from kvpilot.engine.offload.host_store import HostStore

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
        self.cache_tiers = (HOST, DISK) if self.disk is not None else (HOST,)
        # Lookup sources waiting for a listed save to run (filled in by _run_saves).
        self._awaiting: dict[BlockHash, PendingBlock] = {}
        logger.info("KV offload (native): CPU tier %.2f GiB (%d blocks of %d KiB)%s",
                    config.cpu_gib, self.host.capacity_blocks, bpb // 1024,
                    f", disk tier {config.disk_gib:.2f} GiB at {config.disk_path}"
                    if self.disk is not None else "")

    # ---- lookups ------------------------------------------------------------
    def _fetch(self, request: Request, start_block: int, max_blocks: int,
               pending_saves: Mapping[BlockHash, int]) -> Fetched:
        sources = Fetched()
        sources.tiers = tiers = []
        for block_hash in request.block_hashes[start_block:start_block + max_blocks]:
            source: Source | None = self.host.get(block_hash)
            tier = HOST   # a pending save goes to host memory first
            if (source is None and block_hash in pending_saves
                    and not (self.disk is not None and block_hash in self.disk)):
                source = self._awaiting.get(block_hash)
                if source is None:
                    source = self._awaiting[block_hash] = PendingBlock(
                        pending_saves[block_hash], block_hash)
            if source is None and self.disk is not None:
                found = self.disk.read(block_hash)
                if found is not None:
                    source, tier = found[0], DISK
            if source is None:
                break
            sources.append(source)
            tiers.append(tier)
        return sources

    # ---- saves --------------------------------------------------------------
    def _run_saves(self, transfers: KVTransfers) -> None:
        listed = list(transfers.evicted)
        for finished in transfers.finished:
            listed += zip(finished.block_ids, finished.block_hashes, strict=True)
        todo: dict[BlockHash, int] = {}
        for block_id, block_hash in listed:
            if (block_hash in todo or block_hash in self.host
                    or (self.disk is not None and block_hash in self.disk)):
                continue
            todo[block_hash] = block_id
        if todo:
            payloads, ready = self.block_io.gather(list(todo.values()))
            self.counters.gpu_to_cpu += len(todo) * self.block_io.bytes_per_block
            for block_hash, payload in zip(todo, payloads, strict=True):
                self.host.put(block_hash, payload)
                waiting = self._awaiting.pop(block_hash, None)
                if waiting is not None:
                    waiting.payload = payload
                if self.disk is not None:
                    self.disk.submit(block_hash, payload, ready)
        for block_hash in [h for h in self._awaiting if h in transfers.pending_saves]:
            # Listed but not copied because the host tier held it already.
            self._awaiting.pop(block_hash).payload = self.host.get(block_hash)

    # ---- lifecycle / stats --------------------------------------------------------
    def attach_events(self, events) -> None:
        self.host.events = events
        if self.disk is not None:
            self.disk.events = events

    def set_eviction_hook(self, hook) -> None:
        # the host tier's LRU evictions (the engine's thread); with a disk tier below, a
        # block dropped here may still be served from disk, and then it is no miss at all
        self.host.on_evict = hook

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _tier_stats(self) -> dict[str, int | None]:
        figures: dict[str, int | None] = {"cpu_used": self.host.used_bytes,
                                          "cpu_capacity": self.host.capacity_bytes}
        if self.disk is not None:
            figures.update(disk_used=self.disk.used_bytes, disk_capacity=self.disk.capacity_bytes,
                           cpu_to_disk=self.disk.bytes_written, disk_to_cpu=self.disk.bytes_read,
                           disk_writable=self.disk.writable, corrupt=self.disk.num_corrupt)
        return figures
