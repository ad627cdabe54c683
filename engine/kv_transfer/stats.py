"""Figures of KV transfer between engines, in vLLM's NIXL metrics' terms (torch-free).

The worker half keeps ``TransferCounters`` (engine thread only); ``EngineStats.kv_transfer``
carries a frozen ``KVTransferStats`` snapshot, which the server exports as
``kvpilot:nixl_*`` metrics (``server.metrics_kv_transfer``): transfer time, bytes and
descriptors per transfer as histograms (cumulative bucket counts kept here), failed
transfers, and requests whose held KV expired on the prefill side.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

# Upper bounds of the per-transfer histograms (vLLM's nixl_xfer_time_seconds buckets, and
# powers of four from 64 KiB for bytes).
XFER_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS = tuple(float(1 << (16 + 2 * i)) for i in range(10))          # 64 KiB .. 16 GiB
DESCRIPTOR_BUCKETS = tuple(float(4 ** i) for i in range(1, 11))              # 4 .. ~1M


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (``+Inf`` last), and the sum of observations."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]     # len(buckets) + 1, cumulative
    total: float

    @property
    def count(self) -> int:
        return self.counts[-1]


@dataclass(slots=True)
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(self.buckets, tuple(cumulative), self.total)


@dataclass(frozen=True, slots=True)
class KVTransferStats:
    """A snapshot (cumulative counters, plus the state now)."""

    role: str                          # kv_producer / kv_consumer / kv_both
    xfer_time: HistogramSnapshot       # seconds per completed read (consumer)
    bytes_transferred: HistogramSnapshot
    descriptors: HistogramSnapshot
    num_failed_transfers: int          # reads that failed (consumer)
    num_failed_notifications: int      # releases the producer never got (consumer)
    num_expired_requests: int          # held KV freed by the timeout, never read (producer)
    num_held_requests: int             # finished requests whose blocks wait for a reader now
    num_blocks_received: int           # blocks read into this engine (consumer)
    num_failed_loads: int = 0          # requests whose load failed in part or whole (scheduler)
    num_recomputed_tokens: int = 0     # of those, tokens computed here instead

    def with_scheduler_counts(self, failed_loads: int, recomputed_tokens: int) -> KVTransferStats:
        return dataclasses.replace(self, num_failed_loads=failed_loads, num_recomputed_tokens=recomputed_tokens)


class TransferCounters:
    """What the worker half counts as transfers end (one thread)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.xfer_time = _Histogram(XFER_TIME_BUCKETS)
        self.bytes = _Histogram(BYTES_BUCKETS)
        self.descriptors = _Histogram(DESCRIPTOR_BUCKETS)
        self.failed_transfers = 0
        self.failed_notifications = 0
        self.expired = 0
        self.blocks_received = 0

    def transferred(self, seconds: float, num_bytes: int, num_descriptors: int, num_blocks: int) -> None:
        self.xfer_time.observe(seconds)
        self.bytes.observe(num_bytes)
        self.descriptors.observe(num_descriptors)
        self.blocks_received += num_blocks

    def snapshot(self, num_held: int) -> KVTransferStats:
        return KVTransferStats(self.role, self.xfer_time.snapshot(), self.bytes.snapshot(),
                               self.descriptors.snapshot(), self.failed_transfers,
                               self.failed_notifications, self.expired, num_held, self.blocks_received)
