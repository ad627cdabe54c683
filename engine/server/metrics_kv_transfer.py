"""KV transfer between engines (NixlConnector) as ``kvpilot:nixl_*`` metrics (the figures vLLM's
NixlConnector reports; kvpilot namespace: the names, types and buckets are not checked against vLLM's).

Read at scrape time from the newest ``EngineStats.kv_transfer`` snapshot (cumulative
histogram buckets and counters kept by the connector's worker half, ``kv_transfer.stats``);
nothing is exported by an engine without a transfer connector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

_HISTOGRAMS = (
    ("kvpilot:nixl_xfer_time_seconds", "xfer_time",
     "Seconds per NIXL KV read (decode engine: from posting the read to its end)."),
    ("kvpilot:nixl_bytes_transferred", "bytes_transferred", "Bytes per NIXL KV read (decode engine)."),
    ("kvpilot:nixl_num_descriptors", "descriptors",
     "NIXL descriptors per KV read (one per layer, K/V and run of consecutive blocks)."),
)
_COUNTERS = (
    ("kvpilot:nixl_num_failed_transfers", "num_failed_transfers",
     "NIXL KV reads that failed (decode engine): the prefill engine died (before or during the "
     "read), refused the handshake or no longer held the blocks."),
    ("kvpilot:nixl_num_failed_notifications", "num_failed_notifications",
     "Releases of unread KV the prefill engine never got (decode engine)."),
    ("kvpilot:nixl_num_kv_expired_reqs", "num_expired_requests",
     "Requests whose KV a prefill engine held for a decode engine that never read it, freed "
     "after kv_lease_duration (prefill engine)."),
    ("kvpilot:kv_transfer_blocks_received", "num_blocks_received",
     "KV blocks read from prefill engines (decode engine; of a read that failed part-way, those "
     "that arrived before the failure)."),
    ("kvpilot:kv_transfer_failed_loads", "num_failed_loads",
     "Requests whose KV load failed in part or whole (decode engine): recomputed here or failed, "
     "per kv_load_failure_policy."),
    ("kvpilot:kv_transfer_recomputed_tokens", "num_recomputed_tokens",
     "Prompt tokens computed on the decode engine because their KV load failed."),
)


class KVTransferCollector:
    """Args:
        source: returns the newest ``EngineStats`` (or None while loading).
        model_name: the ``model_name`` label value.
    """

    def __init__(self, source: Callable[[], object | None], model_name: str) -> None:
        self._source = source
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return []   # exported only when an engine has a transfer connector

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        transfer = getattr(stats, "kv_transfer", None)
        if transfer is None:
            return
        labels = [self._model_name]
        for name, field, documentation in _HISTOGRAMS:
            snapshot = getattr(transfer, field)
            family = HistogramMetricFamily(name, documentation, labels=["model_name"])
            bounds = [*(repr(float(b)) for b in snapshot.buckets), "+Inf"]
            family.add_metric(labels, list(zip(bounds, map(float, snapshot.counts), strict=True)),
                              sum_value=snapshot.total)
            yield family
        for name, field, documentation in _COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, float(getattr(transfer, field)))
            yield family
        held = GaugeMetricFamily("kvpilot:kv_transfer_held_requests",
                                 "Finished requests whose KV a prefill engine holds now for a decode "
                                 "engine to read.", labels=["model_name"])
        held.add_metric(labels, float(transfer.num_held_requests))
        yield held
