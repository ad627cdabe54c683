"""Metrics read from the engine's ``EngineStats`` snapshot at scrape time: one table.

Each ``StatMetric`` row names an exposed metric and the snapshot field (or property) it
reads. A row whose field the snapshot lacks, or holds as None (offload fields when
offloading is off, the MFU estimates without ``--enable-mfu-metrics``), is skipped, so
a metric exists exactly when the engine has the figure. Speculative decoding's counters
(``vllm:spec_decode_*``, one sample per draft position for the per-position counter) come
from the snapshot's ``spec_decoding`` and exist only when speculation is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpilot.engine.core.prefix_miss import MISS_REASONS


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
    StatMetric("kvpilot:kv_offload_disk_writable", "gauge", "kv_offload_disk_writable",
               "1 while the disk offload tier takes new blocks; 0 once a write failed (a full or "
               "failing volume): offload goes on with the CPU tier until a restart."),
    StatMetric("kvpilot:kv_offload_corrupt_blocks", "counter", "kv_offload_corrupt_blocks",
               "KV blocks read back from an offload tier that failed their integrity check "
               "(checksum, header, layout; LMCache: per chunk), dropped and recomputed."),
)

_MISS_DOC = ("Uncached prompt tokens of admitted requests by why they missed the prefix cache, "
             "decided at first admission (kvpilot's own): never_seen, evicted_capacity / "
             "evicted_preemption / evicted_offload_full (the block was cached here and evicted by "
             "an allocation / after a preemption released it / from a full offload tier), "
             "different_cache_salt, different_lora_adapter, divergence (the prefix continued "
             "differently than what was cached), last_partial_block, last_token (fully cached "
             "prompt: its last token is computed) and too_short (the prompt fits in one block).")

# Where cached prompt tokens' KV came from (vLLM's CacheHitSource): device = the prefix cache.
_CACHED_BY_SOURCE_DOC = ("Prompt tokens of admitted sequences not computed, by the cache tier that "
                         "held them, counted at first admission: device (the prefix cache), host "
                         "(the CPU offload tier), disk (the disk offload tier), external_unspecified "
                         "(LMCache, or a prefill engine over NIXL). The sources sum to vllm:prompt_tokens_cached.")

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
    *(StatMetric("vllm:num_requests_waiting_by_reason", "gauge", field,
                 "Waiting requests by why they wait: capacity (no batch slot or KV blocks yet) or "
                 "deferred (their KV is on its way from a prefill engine).", (("reason", reason),))
      for reason, field in (("capacity", "num_waiting_for_capacity"),
                            ("deferred", "num_waiting_deferred"))),
    *(StatMetric("vllm:prompt_tokens_by_source", "counter", field,
                 "Prompt tokens of admitted sequences by source, counted at first admission: "
                 "local_compute (run through the model), local_cache_hit (device prefix cache), "
                 "external_kv_transfer (loaded by a KV connector: the offload tiers or a prefill "
                 "engine).", (("source", source),))
      for source, field in (("local_compute", "prompt_tokens_local_compute"),
                            ("local_cache_hit", "prompt_tokens_local_cache_hit"),
                            ("external_kv_transfer", "prompt_tokens_external_kv_transfer"))),
    StatMetric("vllm:prompt_tokens_cached", "counter", "prompt_tokens_cached",
               "Prompt tokens of admitted sequences not computed: device prefix-cache hits plus "
               "offload-tier loads."),
    *(StatMetric("vllm:prompt_tokens_cached_by_source", "counter", field, _CACHED_BY_SOURCE_DOC,
                 (("source", source),))
      for source, field in (("device", "prompt_tokens_local_cache_hit"),
                            ("host", "prompt_tokens_cached_host"),
                            ("disk", "prompt_tokens_cached_disk"),
                            ("external_unspecified", "prompt_tokens_cached_external_unspecified"))),
    *(StatMetric("kvpilot:prefix_cache_miss_tokens", "counter", f"prefix_miss_{reason}", _MISS_DOC,
                 (("reason", reason),))
      for reason in MISS_REASONS),
    StatMetric("vllm:admission_rejections", "counter", "admission_rejections_max_waiting_requests",
               "API requests refused at admission, by the limit that refused them: "
               "max_waiting_requests (--max-waiting-requests; answered 429). One per request, "
               "whatever its n.", (("reason", "max_waiting_requests"),)),
    StatMetric("vllm:prompt_tokens_recomputed", "counter", "prompt_tokens_recomputed",
               "Prompt tokens the device prefix cache held but that were computed again, counted "
               "at first admission: a step computes at least a prompt's last token, so a fully "
               "cached prompt recomputes its last block."),
    StatMetric("vllm:corrupted_requests", "counter", "num_corrupted_reqs",
               "Requests whose logits held a NaN in some step (checked only with "
               "VLLM_COMPUTE_NANS_IN_LOGITS=1: a device sync per step)."),
    StatMetric("vllm:estimated_flops_per_gpu", "counter", "estimated_flops",
               "Floating-point operations the engine's steps needed per GPU, estimated from the "
               "model's shape (--enable-mfu-metrics); rate() / peak FLOP/s = MFU."),
    StatMetric("vllm:estimated_read_bytes_per_gpu", "counter", "estimated_read_bytes",
               "Bytes the engine's steps read per GPU (weights once per step, the KV context), "
               "estimated from the model's shape (--enable-mfu-metrics)."),
    StatMetric("vllm:estimated_write_bytes_per_gpu", "counter", "estimated_write_bytes",
               "Bytes the engine's steps wrote per GPU (the new tokens' KV), estimated from the "
               "model's shape (--enable-mfu-metrics)."),
    StatMetric("kvpilot:kv_cache_free_blocks", "gauge", "num_free_blocks",
               "KV cache blocks no running request holds (cached-only blocks included)."),
    StatMetric("kvpilot:engine_steps", "counter", "num_steps", "Model steps the engine ran."),
    StatMetric("kvpilot:prompt_tokens_computed", "counter", "computed_prompt_tokens",
               "Prompt tokens run through the model: prefix-cache hits excluded, recomputes "
               "after preemption included (rate() against vllm:prompt_tokens_by_source shows "
               "the recompute cost of preemption)."),
    *OFFLOAD_STAT_METRICS,
)


SPEC_DECODE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("vllm:spec_decode_num_drafts", "num_drafts",
     "Drafts verified: one per request and step that scored draft tokens."),
    ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens scored."),
    ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens",
     "Draft tokens accepted (1 + accepted / drafts = mean acceptance length)."),
)
SPEC_DECODE_PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos",
                       "Draft tokens accepted at each draft position (0 = the first draft).")


def _spec_decode_families(spec, model_name: str) -> Iterator[Metric]:
    """The speculative-decoding counters of ``spec`` (a ``SpecDecodingStats``)."""
    for name, field, doc in SPEC_DECODE_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model_name], float(getattr(spec, field)))
        yield family
    family = CounterMetricFamily(*SPEC_DECODE_PER_POS, labels=["model_name", "position"])
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        family.add_metric([model_name, str(position)], float(count))
    yield family


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
        spec = [CounterMetricFamily(name, doc) for name, _, doc in SPEC_DECODE_COUNTERS]
        return [self._family(rows[0]) for rows in self._groups] + spec + [
            CounterMetricFamily(*SPEC_DECODE_PER_POS)]

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
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            yield from _spec_decode_families(spec, self._model_name)

    @staticmethod
    def _family(metric: StatMetric) -> Metric:
        cls = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
        return cls(metric.name, metric.documentation,
                   labels=["model_name", *(k for k, _ in metric.labels)])
