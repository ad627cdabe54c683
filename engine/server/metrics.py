"""Every Prometheus object of the server, under vLLM's metric names (``kvpilot:`` where
vLLM has no metric for the figure).

Dashboards, KEDA triggers, AIBrix and the Gateway API inference extension read
vLLM's names, so kvpilot exports the same ones. Two sources feed them:

- engine state and cumulative counters (KV usage, queue lengths, prefix-cache and
  token counters, KV offloading) are read from the latest ``EngineStats`` snapshot at
  scrape time by a custom collector, driven by the ``ENGINE_STAT_METRICS`` table; a row
  whose field the snapshot lacks (or holds None, as offload fields do when offloading
  is off) is skipped;
- per-request histograms and the success counter are recorded from the
  ``IterationStats`` the engine thread reports.

All objects live in the ``CollectorRegistry`` passed in and carry ``model_name``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpilot.engine.server.latency_tracker import ABORT, ERROR, IterationStats

FINISHED_REASONS = ("stop", "length", ABORT, ERROR)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1-2-5 series (1, 2, 5, 10, 20, 50, ...) up to and including ``max_value``."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    buckets: list[float] = []
    power = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * power
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        power *= 10


@dataclass(frozen=True, slots=True)
class StatMetric:
    """One metric read from an ``EngineStats`` field at scrape time.

    ``name`` is the exposed name; counters are declared without ``_total`` (the
    client library appends it). Rows sharing a name form one metric whose samples
    differ in the fixed ``labels`` (e.g. ``transfer_type``); such rows must agree on
    kind, documentation and label names.
    """

    name: str
    kind: Literal["gauge", "counter"]
    field: str
    documentation: str
    labels: tuple[tuple[str, str], ...] = ()


_OFFLOAD_BYTES_DOC = ("Bytes of KV blocks moved by KV offloading, by transfer_type: GPU_to_CPU "
                      "(device cache to host memory), CPU_to_GPU (back into the device cache), "
                      "CPU_to_disk (written to the disk tier), disk_to_CPU (read from it).")

# KV offloading (--kv-offloading-size ...): exported only when the engine reports them.
OFFLOAD_STAT_METRICS: tuple[StatMetric, ...] = (
    StatMetric("vllm:external_prefix_cache_queries", "counter", "external_prefix_cache_queries",
               "Prompt tokens of admitted requests looked up in the KV offload tiers."),
    StatMetric("vllm:external_prefix_cache_hits", "counter", "external_prefix_cache_hits",
               "Prompt tokens loaded from the KV offload tiers instead of being computed."),
    *(StatMetric("vllm:kv_offload_total_bytes", "counter", field, _OFFLOAD_BYTES_DOC,
                 (("transfer_type", transfer),))
      for transfer, field in (("GPU_to_CPU", "kv_offload_gpu_to_cpu_bytes"),
                              ("CPU_to_GPU", "kv_offload_cpu_to_gpu_bytes"),
                              ("CPU_to_disk", "kv_offload_cpu_to_disk_bytes"),
                              ("disk_to_CPU", "kv_offload_disk_to_cpu_bytes"))),
    StatMetric("kvpilot:kv_offload_cpu_usage_bytes", "gauge", "kv_offload_cpu_used_bytes",
               "Bytes of KV blocks held in the CPU (host memory) offload tier."),
    StatMetric("kvpilot:kv_offload_cpu_capacity_bytes", "gauge", "kv_offload_cpu_capacity_bytes",
               "Capacity of the CPU offload tier in bytes (--kv-offloading-size)."),
    StatMetric("kvpilot:kv_offload_disk_usage_bytes", "gauge", "kv_offload_disk_used_bytes",
               "Bytes of KV block files in the disk offload tier."),
    StatMetric("kvpilot:kv_offload_disk_capacity_bytes", "gauge", "kv_offload_disk_capacity_bytes",
               "Capacity of the disk offload tier in bytes (--kv-offloading-disk-size)."),
)

ENGINE_STAT_METRICS: tuple[StatMetric, ...] = (
    StatMetric("vllm:kv_cache_usage_perc", "gauge", "kv_cache_usage",
               "KV cache usage as a fraction of all blocks (0 to 1; 1 = full). Blocks kept only "
               "for prefix-cache reuse count as free."),
    StatMetric("vllm:num_requests_running", "gauge", "num_running_reqs",
               "Sequences in the running batch."),
    StatMetric("vllm:num_requests_waiting", "gauge", "num_waiting_reqs",
               "Requests waiting for a batch slot, including submissions the engine has not yet "
               "admitted."),
    StatMetric("vllm:prefix_cache_queries", "counter", "prefix_cache_queries",
               "Prompt tokens looked up in the prefix cache."),
    StatMetric("vllm:prefix_cache_hits", "counter", "prefix_cache_hits",
               "Prompt tokens found in the prefix cache (hits / queries = hit rate)."),
    StatMetric("vllm:num_preemptions", "counter", "num_preemptions",
               "Sequences preempted (KV blocks freed, recomputed later) for lack of KV blocks."),
    StatMetric("vllm:prompt_tokens", "counter", "prompt_tokens",
               "Prompt tokens of requests that started generating (prefix-cache hits included)."),
    StatMetric("vllm:generation_tokens", "counter", "generation_tokens",
               "Tokens generated."),
    *OFFLOAD_STAT_METRICS,
)


class EngineStatsCollector:
    """Reads the newest ``EngineStats`` snapshot whenever Prometheus scrapes.

    Args:
        source: returns the snapshot, or None while the engine is loading (then
            nothing is exported).
        model_name: the ``model_name`` label value.
        metrics: the table of exported fields.
    """

    def __init__(self, source: Callable[[], object | None], model_name: str,
                 metrics: tuple[StatMetric, ...] = ENGINE_STAT_METRICS) -> None:
        self._source = source
        self._model_name = model_name
        # Rows grouped by metric name once, not at every scrape.
        groups: dict[str, list[StatMetric]] = {}
        for metric in metrics:
            groups.setdefault(metric.name, []).append(metric)
        self._groups = tuple(tuple(rows) for rows in groups.values())

    def describe(self) -> list[Metric]:
        # Non-empty describe() lets the registry catch name clashes at registration.
        return [self._family(rows[0]) for rows in self._groups]

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        if stats is None:
            return
        for rows in self._groups:
            family = None
            for metric in rows:
                value = getattr(stats, metric.field, None)
                if value is None:
                    continue
                if family is None:
                    family = self._family(metric)
                family.add_metric([self._model_name, *(v for _, v in metric.labels)], float(value))
            if family is not None:
                yield family

    @staticmethod
    def _family(metric: StatMetric) -> Metric:
        cls = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
        return cls(metric.name, metric.documentation,
                   labels=["model_name", *(k for k, _ in metric.labels)])


def make_registry() -> CollectorRegistry:
    """A fresh registry with the process, platform and garbage-collector metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def _kv_memory_gauges(registry: CollectorRegistry, model_name: str, cache_info) -> None:
    """The KV cache's bytes as allocated, and what start-up profiling left for it (the
    latter only when the engine profiled: on CUDA, or against the test hook's GPU)."""
    Gauge("kvpilot:kv_cache_memory_bytes",
          "Bytes of the KV cache as allocated (num_gpu_blocks x bytes per block; the pinned "
          "--kv-cache-memory-bytes rounded down to whole blocks).",
          labelnames=["model_name"], registry=registry).labels(model_name).set(cache_info.kv_cache_memory_bytes)
    if cache_info.profiled_available_bytes is not None:
        Gauge("kvpilot:kv_cache_profiled_available_bytes",
              "Bytes start-up profiling left for the KV cache at --gpu-memory-utilization: "
              "utilization x total - weights - activation peak - non-torch memory.",
              labelnames=["model_name"], registry=registry).labels(model_name).set(
                  cache_info.profiled_available_bytes)


class ServerMetrics:
    """The server's Prometheus metrics for one served model.

    Args:
        registry: where every metric is registered.
        model_name: value of the ``model_name`` label.
        cache_info: the engine's ``KVCacheInfo`` (exported as ``vllm:cache_config_info``).
        max_model_len: upper end of the token-count histogram buckets.
        stats_source: returns the newest ``EngineStats`` snapshot (or None).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, cache_info,
                 max_model_len: int, stats_source: Callable[[], object | None]) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        registry.register(EngineStatsCollector(stats_source, model_name))

        info_labels = {
            "block_size": str(cache_info.block_size),
            "cache_dtype": str(cache_info.kv_cache_dtype),
            "num_gpu_blocks": str(cache_info.num_gpu_blocks),
            "gpu_memory_utilization": str(cache_info.gpu_memory_utilization),
            "enable_prefix_caching": str(cache_info.enable_prefix_caching),
        }
        cache_config = Gauge(
            "vllm:cache_config_info", "KV cache configuration as labels; the value is always 1.",
            labelnames=[*labels, *info_labels], registry=registry)
        cache_config.labels(model_name=model_name, **info_labels).set(1)
        _kv_memory_gauges(registry, model_name, cache_info)

        self._success = Counter(
            "vllm:request_success",
            "Finished completion choices by finish reason: stop (EOS, stop string or stop "
            "token), length (max_tokens or context), abort (client went away), error.",
            labelnames=[*labels, "finished_reason"], registry=registry)
        for reason in FINISHED_REASONS:  # export zeros so rate() works from the start
            self._success.labels(model_name, reason)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, labelnames=labels, buckets=buckets,
                             registry=registry).labels(model_name)

        token_counts = token_buckets(max_model_len)
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive engine steps that gave a request new tokens.",
            ITL_BUCKETS)
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token (finished requests).",
            REQUEST_LATENCY_BUCKETS)
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Seconds a finished request waited before it was first scheduled.",
            REQUEST_LATENCY_BUCKETS)
        self._prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests, in tokens.",
            token_counts)
        self._generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Tokens generated by finished requests (all n choices together).", token_counts)

    def record(self, iteration: IterationStats) -> None:
        """Records one engine iteration's request events (called on the engine thread)."""
        for ttft in iteration.time_to_first_tokens:
            self._ttft.observe(ttft)
        for itl in iteration.inter_token_latencies:
            self._itl.observe(itl)
        for finished in iteration.finished:
            for reason in finished.finish_reasons:
                self._success.labels(self.model_name, reason).inc()
            if finished.e2e_latency is not None:
                self._e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self._queue.observe(finished.queue_time)
            if finished.num_prompt_tokens is not None:
                self._prompt_tokens.observe(finished.num_prompt_tokens)
            if finished.num_generation_tokens is not None:
                self._generation_tokens.observe(finished.num_generation_tokens)
