"""What every offload backend shares: the lookup half and the executor half.

Wiring runs one way, through the KV-connector API (``offload.connector`` wraps a backend):

- the connector's scheduler half calls the lookup half at admission: ``find_hit`` extends the device
  prefix hit with blocks from the tiers, fetched into host memory right there (a disk
  read or an LMCache retrieve; a host-tier hit is just a reference), so a granted hit can
  never fail later; the fetch is kept for the request if it cannot be admitted this
  step, and ``forget`` drops it when the request leaves;
- the scheduler half lists the step's saves (blocks the pool evicted, finished requests'
  blocks) and admissions in a ``KVTransfers`` (``core/kv_transfer.py``), which travels in
  ``SchedulerOutput.kv_connector_metadata``;
- the worker half calls the executor half, ``execute(transfers)``, before the forward pass:
  the saves, then the loads of the admitted requests' hits into their new blocks.

The block pool and the KV cache manager know nothing about offloading. Saves run before
loads, so a block evicted and reused in the same step is saved before it is overwritten,
and loaded KV is in place before attention reads it. When the engine goes idle it hands
the listed saves to ``execute`` at once rather than at the next step.

Preemption still means recompute: a preempted request's blocks are not written through
as a finished request's are (only, like any cached block, saved if the pool evicts
them), and at re-admission it takes whatever hits the device pool and tiers have.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvpilot.engine.core.block_hash import BlockHash
from kvpilot.engine.core.kv_connector import EXTERNAL_UNSPECIFIED
from kvpilot.engine.core.kv_transfer import KVTransfers
from kvpilot.engine.core.request import Request
from kvpilot.engine.offload.block_io import BlockIO

logger = logging.getLogger(__name__)


class PendingBlock:
    """A block queued for saving; ``payload`` is set when the save runs."""

    __slots__ = ("block_id", "block_hash", "payload")

    def __init__(self, block_id: int, block_hash: BlockHash) -> None:
        self.block_id = block_id
        self.block_hash = block_hash
        self.payload: torch.Tensor | None = None


Source = torch.Tensor | PendingBlock   # where a granted block's payload comes from


@dataclass(slots=True)
class OffloadCounters:
    """Cumulative counters kept by the shared half (tokens for the hit rate, bytes moved)."""

    queries: int = 0          # prompt tokens of admitted requests looked up in the tiers
    hits: int = 0             # of which served from the tiers (loaded, not computed)
    gpu_to_cpu: int = 0       # bytes saved from the device KV cache into host memory
    cpu_to_gpu: int = 0       # bytes loaded from host memory into the device KV cache
    fetch_seconds: float = 0.0      # time spent fetching hits at admission (disk reads...)
    transfer_seconds: float = 0.0   # time spent in execute() (saves + loads)


TRANSFER_TYPES = ("GPU_to_CPU", "CPU_to_GPU", "CPU_to_disk", "disk_to_CPU")


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """A snapshot of the counters and tier usage; None where a backend cannot tell."""

    queries: int
    hits: int
    bytes_by_transfer: dict[str, int | None]   # keys: TRANSFER_TYPES
    cpu_used_bytes: int | None
    cpu_capacity_bytes: int | None
    disk_used_bytes: int | None
    disk_capacity_bytes: int | None
    fetch_seconds: float
    transfer_seconds: float
    disk_writable: bool | None = None        # the disk tier still takes new blocks
    corrupt_blocks: int | None = None        # blocks (LMCache: chunks) that failed their check

    def engine_stat_fields(self) -> dict[str, int | None]:
        """The ``EngineStats`` keyword arguments these figures fill."""
        moved = self.bytes_by_transfer
        return {
            "external_prefix_cache_queries": self.queries,
            "external_prefix_cache_hits": self.hits,
            "kv_offload_gpu_to_cpu_bytes": moved["GPU_to_CPU"],
            "kv_offload_cpu_to_gpu_bytes": moved["CPU_to_GPU"],
            "kv_offload_cpu_to_disk_bytes": moved["CPU_to_disk"],
            "kv_offload_disk_to_cpu_bytes": moved["disk_to_CPU"],
            "kv_offload_cpu_used_bytes": self.cpu_used_bytes,
            "kv_offload_cpu_capacity_bytes": self.cpu_capacity_bytes,
            "kv_offload_disk_used_bytes": self.disk_used_bytes,
            "kv_offload_disk_capacity_bytes": self.disk_capacity_bytes,
            "kv_offload_disk_writable": self.disk_writable,
            "kv_offload_corrupt_blocks": self.corrupt_blocks,
        }




class Fetched(list):
    """What ``_fetch`` returns: the sources, and (``tiers``, one per source) the tier each
    comes from, for a backend that can tell (else None: ``EXTERNAL_UNSPECIFIED``)."""

    tiers: list[str] | None = None


@dataclass(slots=True)
class _Prefetch:
    start_block: int
    sources: list[Source] = field(default_factory=list)
    tiers: list[str] | None = None


class OffloadBase(abc.ABC):
    """Shared half of every backend: prefetch bookkeeping, loads, counters.

    Subclasses implement ``_fetch`` (admission-time lookup + fetch) and ``_run_saves``.

    Args:
        block_size: tokens per block.
        block_io: copies blocks in and out of the device cache.
    """

    # The tiers this backend's hits can come from (``hit_tiers``' keys).
    cache_tiers: tuple[str, ...] = (EXTERNAL_UNSPECIFIED,)

    def __init__(self, block_size: int, block_io: BlockIO) -> None:
        self.block_size = block_size
        self.block_io = block_io
        self.counters = OffloadCounters()
        self._prefetched: dict[str, _Prefetch] = {}

    # ---- lookup half (called by the scheduler) ------------------------------
    def find_hit(self, request: Request, num_device_blocks: int,
                 pending_saves: Mapping[BlockHash, int]) -> int:
        """Blocks after the device hit that the tiers hold (already fetched to host)."""
        max_blocks = (request.num_tokens - 1) // self.block_size - num_device_blocks
        if max_blocks <= 0:
            return 0
        cached = self._prefetched.get(request.request_id)
        if cached is None or cached.start_block != num_device_blocks:
            start = time.perf_counter()
            try:
                sources = self._fetch(request, num_device_blocks, max_blocks, pending_saves)
            except Exception as exc:  # noqa: BLE001 - an offload tier must never fail a request
                logger.warning("KV offload lookup failed for %s (%s: %s); computing its prefix",
                               request.request_id, type(exc).__name__, exc)
                sources = []
            self.counters.fetch_seconds += time.perf_counter() - start
            cached = self._prefetched[request.request_id] = _Prefetch(
                num_device_blocks, sources, getattr(sources, "tiers", None))
        return min(len(cached.sources), max_blocks)

    def hit_tiers(self, request_id: str, num_blocks: int) -> dict[str, int]:
        """Blocks of the first ``num_blocks`` of a request's granted hit by the tier that
        serves them (``HOST``, ``DISK``, ``EXTERNAL_UNSPECIFIED``)."""
        cached = self._prefetched.get(request_id)
        tiers = cached.tiers if cached is not None else None
        if tiers is None:
            return {EXTERNAL_UNSPECIFIED: num_blocks}
        counts: dict[str, int] = {}
        for tier in tiers[:num_blocks]:
            counts[tier] = counts.get(tier, 0) + 1
        return counts

    def forget(self, request_id: str) -> None:
        """Drops the fetch of a request that leaves (finished, aborted or preempted)."""
        self._prefetched.pop(request_id, None)

    # ---- executor half (called by the runner) ---------------------------------
    def execute(self, transfers: KVTransfers) -> None:
        """The step's saves, then the loads of its admissions; before the forward pass."""
        start = time.perf_counter()
        self._run_saves(transfers)
        block_ids: list[int] = []
        payloads: list[torch.Tensor] = []
        for admission in transfers.admissions:
            cached = self._prefetched.pop(admission.request_id, None)
            self.counters.queries += admission.num_tokens
            if not admission.block_ids:
                continue
            if cached is None or cached.start_block != admission.start_block:
                raise RuntimeError(f"offload hit of {admission.request_id} admitted without its fetch")
            for source in cached.sources[:len(admission.block_ids)]:
                payload = source.payload if isinstance(source, PendingBlock) else source
                if payload is None:
                    raise RuntimeError("a load's source block was never saved")
                payloads.append(payload)
            block_ids += admission.block_ids
            self.counters.hits += len(admission.block_ids) * self.block_size
        if block_ids:
            self.block_io.scatter(block_ids, payloads)
            self.counters.cpu_to_gpu += len(block_ids) * self.block_io.bytes_per_block
        self.counters.transfer_seconds += time.perf_counter() - start

    def flush(self) -> None:
        """Waits until background writes (the disk tier's) are done."""
        return

    def attach_events(self, events) -> None:
        """Record blocks entering and leaving the tiers in ``events`` (a ``KVEventLog``) for
        the KV-event publisher. The default announces nothing: a backend whose evictions
        it cannot observe (LMCache's) would otherwise leave consumers with stale blocks."""
        return

    def set_eviction_hook(self, hook) -> None:
        """Call ``hook(block_hash)`` for each block a tier drops to make room (the
        prefix-miss explainer's ``evicted_offload_full``). The default reports nothing: a
        backend whose evictions it cannot see (LMCache's) leaves them unexplained."""
        return

    def close(self) -> None:
        self.flush()

    def stats(self) -> OffloadStats:
        c = self.counters
        tiers = self._tier_stats()
        return OffloadStats(
            queries=c.queries, hits=c.hits,
            bytes_by_transfer={"GPU_to_CPU": c.gpu_to_cpu, "CPU_to_GPU": c.cpu_to_gpu,
                               "CPU_to_disk": tiers.get("cpu_to_disk"),
                               "disk_to_CPU": tiers.get("disk_to_cpu")},
            cpu_used_bytes=tiers.get("cpu_used"), cpu_capacity_bytes=tiers.get("cpu_capacity"),
            disk_used_bytes=tiers.get("disk_used"), disk_capacity_bytes=tiers.get("disk_capacity"),
            fetch_seconds=c.fetch_seconds, transfer_seconds=c.transfer_seconds,
            disk_writable=tiers.get("disk_writable"), corrupt_blocks=tiers.get("corrupt"),
        )

    def _tier_stats(self) -> dict[str, int | None]:
        """Backend-specific figures: cpu_used, cpu_capacity, disk_used, disk_capacity,
        cpu_to_disk, disk_to_cpu (bytes), disk_writable, corrupt (absent = unknown)."""
        return {}

    # ---- backend hooks --------------------------------------------------------
    @abc.abstractmethod
    def _fetch(self, request: Request, start_block: int, max_blocks: int,
               pending_saves: Mapping[BlockHash, int]) -> list[Source]:
        """Implemented by each backend."""

    @abc.abstractmethod
    def _run_saves(self, transfers: KVTransfers) -> None:
        """Implemented by each backend: save the evicted and finished blocks listed."""
