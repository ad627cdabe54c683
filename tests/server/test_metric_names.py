"""The server's metrics against docs/metrics.md's table and against vLLM's names, types, labels
and buckets (``support/vllm_metric_names.py``). The acceptance test with a real Prometheus
(``tests/observability/test_dashboards_live.py``) checks the table against live servers too.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

from kvpilot.engine.config import KVCacheInfo
from kvpilot.engine.core.kv_residency import BlockResidency
from kvpilot.engine.core.spec_stats import SpecDecodingStats
from kvpilot.engine.kv_transfer.stats import TransferCounters
from kvpilot.engine.lora.stats import AdapterCounters, LoRAStats
from kvpilot.engine.runtime.latency_tracker import FinishedRequestStats, IterationStats
from kvpilot.engine.server.metrics import ServerMetrics, token_buckets
from kvpilot.engine.stats import EngineStats

from support.docs_pages import documented_metrics
from support.vllm_metric_names import NOT_APPLICABLE, NOT_EXPORTED, TOKENS, VLLM_METRICS

MAX_MODEL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class Exposed:
    kind: str
    labels: frozenset[str]
    buckets: tuple[float, ...] | None


def _full_stats() -> EngineStats:
    """A real snapshot with every optional figure present (offload on, MFU on, speculative
    decoding on, NIXL on)."""
    values = {f.name: 1 for f in dataclasses.fields(EngineStats)}
    values.update(kv_cache_usage=0.5, num_gpu_blocks=64, num_free_blocks=32,
                  kv_transfer=TransferCounters("kv_both").snapshot(num_held=1),
                  lora=LoRAStats(4, ("sql", "chat"), ("chat",), (AdapterCounters("sql", 3, 30, 12),),
                                 2, 2, 2),
                  spec_decoding=SpecDecodingStats(4, 12, 7, (4, 2, 1)))
    return EngineStats(**values)


def registry_metrics() -> dict[str, Exposed]:
    """Exposed name -> type, labels, buckets of everything a real ServerMetrics exports
    with every optional figure on (after one recorded iteration)."""
    registry = CollectorRegistry()
    info = KVCacheInfo(num_gpu_blocks=64, block_size=16, kv_cache_dtype="float32",
                       bytes_per_block=1024, kv_cache_memory_bytes=65536,
                       enable_prefix_caching=True, gpu_memory_utilization=0.9,
                       profiled_available_bytes=1 << 20)
    metrics = ServerMetrics(registry, "m", info, MAX_MODEL_LEN, _full_stats, kv_cache_metrics=True,
                            max_loras=4)
    finished = FinishedRequestStats(("stop",), 1.0, 0.1, 5, 3, prefill_time=0.2, decode_time=0.7,
                                    inference_time=0.9, time_per_output_token=0.35, n=1,
                                    max_tokens=3, max_num_generation_tokens=3, num_preemptions=1,
                                    prefill_kv_computed_tokens=5)
    metrics.record(IterationStats((0.1,), (0.01,), (finished,), iteration_tokens=(8,),
                                  kv_block_residency=(BlockResidency(2.0, 1.0),
                                                      BlockResidency(reuse_gap_seconds=0.5))))
    exposed = {}
    for family in registry.collect():
        if not family.name.startswith(("vllm:", "kvpilot:")):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        buckets = None
        if family.type == "histogram":
            buckets = tuple(float(s.labels["le"]) for s in family.samples
                            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf")
        exposed[name] = Exposed(family.type, frozenset(labels), buckets)
    return exposed


def test_the_metrics_page_table_is_exactly_what_the_server_exports():
    exposed = {name: e.kind for name, e in registry_metrics().items()}
    assert documented_metrics() == exposed


def test_vllm_names_keep_vllm_types_labels_and_buckets():
    exposed = registry_metrics()
    for name, (kind, labels, buckets) in VLLM_METRICS.items():
        if name not in exposed:
            continue
        ours = exposed[name]
        assert ours.kind == kind, name
        if labels is not None:
            assert ours.labels == {"model_name", *labels}, name
        if buckets is not None:
            expected = token_buckets(MAX_MODEL_LEN) if buckets == TOKENS else buckets
            assert ours.buckets == tuple(float(b) for b in expected), name


def test_every_applicable_vllm_name_is_exported():
    exposed = registry_metrics()
    exported = {name for name in VLLM_METRICS if name in exposed}
    applicable = set(VLLM_METRICS) - set(NOT_APPLICABLE)
    assert exported == applicable - set(NOT_EXPORTED)
    # every vllm: name kvpilot exports is one of vLLM's
    assert {n for n in exposed if n.startswith("vllm:")} <= set(VLLM_METRICS)
    print(f"kvpilot exports {len(exported)} of vLLM's {len(VLLM_METRICS)} metric names "
          f"({len(exported)} of the {len(applicable)} that apply to a text-only engine "
          "without sleep mode)")


def test_a_finished_request_splits_into_vllms_phases():
    """The tracker fed the engine's real output objects: queue, prefill, decode and
    inference time, time per output token and the request's parameters."""
    from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvpilot.engine.runtime.latency_tracker import RequestStatsTracker

    tracker = RequestStatsTracker()
    tracker.add("r", n=2, arrival_time=100.0, max_tokens=8)

    def output(tokens: tuple[list[int], list[int]], finished: bool, now: float) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                                 last_token_time=now, finished_time=now if finished else None,
                                 num_preemptions=2)
        choices = [CompletionOutput(i, "", t, None, None, "length" if finished else None)
                   for i, t in enumerate(tokens)]
        return RequestOutput("r", None, list(range(40)), choices, finished, 24, metrics)

    tracker.on_outputs([output(([1], [2]), False, 101.0)], 101.0)
    tracker.on_outputs([output(([3, 4, 5], [6]), False, 102.5)], 102.5)
    (done,) = tracker.on_outputs([output(([6], []), True, 104.0)], 104.0).finished
    assert (done.queue_time, done.prefill_time, done.decode_time, done.inference_time) == (0.5, 0.5, 3.0, 3.5)
    assert done.e2e_latency == 4.0 == done.queue_time + done.inference_time
    assert done.max_num_generation_tokens == 5 and done.num_generation_tokens == 7
    assert done.time_per_output_token == 3.0 / 4       # decode time over the longest sequence's tokens - 1
    assert (done.n, done.max_tokens, done.num_preemptions, done.prefill_kv_computed_tokens) == (2, 8, 2, 16)
