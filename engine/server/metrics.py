"""Every Prometheus object of the server, under vLLM's metric names (``kvpilot:`` where
vLLM has no metric for the figure).

Dashboards, KEDA triggers, AIBrix and the Gateway API inference extension read
vLLM's names, so kvpilot exports the same ones. Two sources feed them:

- engine state and cumulative counters (KV usage, queue lengths, prefix-cache and
  token counters, KV offloading, MFU estimates) are read from the latest
  ``EngineStats`` snapshot at scrape time (``metrics_engine_stats``);
- per-request and per-step histograms and the success counter are recorded from the
  ``IterationStats`` the engine thread reports (tokens per step, request phases and
  parameters, sampled KV block residency).

All objects live in the ``CollectorRegistry`` passed in and carry ``model_name``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from kvpilot.engine.runtime.latency_tracker import ABORT, ERROR, IterationStats
from kvpilot.engine.server.metrics_engine_stats import EngineStatsCollector
from kvpilot.engine.server.metrics_kv_transfer import KVTransferCollector
from kvpilot.engine.server.metrics_lora import LoRAMetrics

FINISHED_REASONS = ("stop", "length", ABORT, ERROR)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
KV_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20,
                        30, 60, 120, 300, 600, 1200, 1800)


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
        kv_cache_metrics: export the sampled KV block residency histograms
            (``--kv-cache-metrics``).
        max_loras: ``--max-loras`` with LoRA on (``metrics_lora``), else None.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, cache_info,
                 max_model_len: int, stats_source: Callable[[], object | None],
                 kv_cache_metrics: bool = False, max_loras: int | None = None) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        registry.register(EngineStatsCollector(stats_source, model_name))
        registry.register(KVTransferCollector(stats_source, model_name))

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

        tokens = token_buckets(max_model_len)
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive engine steps that gave a request new tokens.",
            ITL_BUCKETS)
        self._iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed by one engine step (prefill chunks and decodes of the batch).",
            ITERATION_TOKENS_BUCKETS)
        # Finished requests: (metric, FinishedRequestStats field), observed when not None.
        self._finished: list[tuple[object, str]] = []

        def finished(name: str, documentation: str, buckets, field: str) -> None:
            self._finished.append((histogram(name, documentation, buckets), field))

        finished("vllm:e2e_request_latency_seconds",
                 "Seconds from a request's arrival to its last token (finished requests).",
                 REQUEST_LATENCY_BUCKETS, "e2e_latency")
        finished("vllm:request_queue_time_seconds",
                 "Seconds a finished request waited before it was first scheduled.",
                 REQUEST_LATENCY_BUCKETS, "queue_time")
        finished("vllm:request_prefill_time_seconds",
                 "Seconds from a finished request's first scheduling to its first token.",
                 REQUEST_LATENCY_BUCKETS, "prefill_time")
        finished("vllm:request_decode_time_seconds",
                 "Seconds from a finished request's first token to its last.",
                 REQUEST_LATENCY_BUCKETS, "decode_time")
        finished("vllm:request_inference_time_seconds",
                 "Seconds from a finished request's first scheduling to its last token "
                 "(prefill + decode).", REQUEST_LATENCY_BUCKETS, "inference_time")
        finished("vllm:request_time_per_output_token_seconds",
                 "A finished request's mean seconds per output token after the first (decode "
                 "time / (tokens - 1) of its longest sequence).", ITL_BUCKETS,
                 "time_per_output_token")
        finished("vllm:request_prompt_tokens", "Prompt length of finished requests, in tokens.",
                 tokens, "num_prompt_tokens")
        finished("vllm:request_generation_tokens",
                 "Tokens generated by finished requests (all n choices together).", tokens,
                 "num_generation_tokens")
        finished("vllm:request_max_num_generation_tokens",
                 "Most tokens one of a finished request's n sequences generated.", tokens,
                 "max_num_generation_tokens")
        finished("vllm:request_params_n", "The n parameter of finished requests.",
                 PARAMS_N_BUCKETS, "n")
        finished("vllm:request_params_max_tokens",
                 "The max_tokens parameter of finished requests that set it.", tokens, "max_tokens")
        finished("vllm:request_prefill_kv_computed_tokens",
                 "Prompt tokens of a finished request whose KV was computed (not found in the "
                 "prefix cache or the offload tiers at first admission).", tokens,
                 "prefill_kv_computed_tokens")
        finished("vllm:request_num_preemptions",
                 "Times a finished request's sequences were preempted (all n together).",
                 PREEMPTIONS_BUCKETS, "num_preemptions")

        self._lora = (LoRAMetrics(registry, model_name, max_loras, stats_source)
                      if max_loras is not None else None)
        self._residency = None
        if kv_cache_metrics:
            self._residency = tuple(histogram(name, documentation, KV_RESIDENCY_BUCKETS) for name, documentation in (
                ("vllm:kv_block_lifetime_seconds",
                 "Seconds a sampled KV block lived, from allocation to eviction "
                 "(--kv-cache-metrics-sample)."),
                ("vllm:kv_block_idle_before_evict_seconds",
                 "Seconds a sampled KV block sat unused (no request holding it) before its "
                 "eviction (--kv-cache-metrics-sample)."),
                ("vllm:kv_block_reuse_gap_seconds",
                 "Seconds from a sampled KV block's previous use (allocation, prefix hit) to a "
                 "prefix hit on it (--kv-cache-metrics-sample)."),
            ))

    def record(self, iteration: IterationStats) -> None:
        """Records one engine iteration's events (called on the engine thread)."""
        for ttft in iteration.time_to_first_tokens:
            self._ttft.observe(ttft)
        for itl in iteration.inter_token_latencies:
            self._itl.observe(itl)
        for num_tokens in iteration.iteration_tokens:
            self._iteration_tokens.observe(num_tokens)
        for finished in iteration.finished:
            for reason in finished.finish_reasons:
                self._success.labels(self.model_name, reason).inc()
            for metric, field in self._finished:
                value = getattr(finished, field)
                if value is not None:
                    metric.observe(value)
        if self._lora is not None:
            self._lora.update()
        if self._residency is not None:
            lifetime, idle, reuse = self._residency
            for event in iteration.kv_block_residency:
                if event.reuse_gap_seconds is not None:
                    reuse.observe(event.reuse_gap_seconds)
                else:
                    lifetime.observe(event.lifetime_seconds)
                    idle.observe(event.idle_seconds)
