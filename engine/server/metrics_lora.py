"""The LoRA metrics: ``vllm:lora_requests_info`` exactly as vLLM exports it, and kvpilot's
counters per adapter.

``vllm:lora_requests_info`` is a gauge without a ``model_name`` label, whose labels are
``max_lora`` (``--max-loras``), ``running_lora_adapters`` and ``waiting_lora_adapters``
(the adapters' names, comma-joined) and whose value is the time (Unix seconds) the engine
last reported that combination: vLLM sets it to the current time on every stats update,
so a reader (the Gateway API inference extension's LoRA-affinity scorer) takes the
sample with the latest value. As in vLLM, combinations seen earlier stay exported with
their older timestamps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LORA_INFO = "vllm:lora_requests_info"


class LoRAMetrics:
    """Args:
        stats_source: the newest ``EngineStats`` snapshot (its ``lora`` field), or None.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int,
                 stats_source: Callable[[], object | None]) -> None:
        self.max_loras = max_loras
        self._stats = stats_source
        self.info = Gauge(LORA_INFO, "Running stats on lora requests.",
                          labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                          registry=registry)
        registry.register(_AdapterCollector(stats_source, model_name))

    def update(self) -> None:
        """Stamp the current running / waiting adapters with the time (vLLM does it on
        every stats update: each engine step)."""
        stats = self._stats()
        lora = getattr(stats, "lora", None)
        if lora is None:
            return
        self.info.labels(max_lora=str(self.max_loras), waiting_lora_adapters=",".join(lora.waiting),
                         running_lora_adapters=",".join(lora.running)).set_to_current_time()


class _AdapterCollector:
    """Counters per adapter and the adapters' residency, read from the snapshot at scrape time."""

    def __init__(self, stats_source: Callable[[], object | None], model_name: str) -> None:
        self._stats = stats_source
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        lora = getattr(self._stats(), "lora", None)
        if lora is None:
            return
        labels = ["model_name", "lora_name"]
        families = (
            ("kvpilot:lora_requests", "Requests added per LoRA adapter.", "num_requests"),
            ("kvpilot:lora_prompt_tokens", "Prompt tokens of finished requests per LoRA adapter.",
             "prompt_tokens"),
            ("kvpilot:lora_generation_tokens", "Generated tokens of finished requests per LoRA adapter.",
             "generation_tokens"),
        )
        for name, doc, field in families:
            family = CounterMetricFamily(name, doc, labels=labels)
            for counters in lora.counters:
                family.add_metric([self._model_name, counters.lora_name], getattr(counters, field))
            yield family
        residency = GaugeMetricFamily(
            "kvpilot:lora_adapters", "LoRA adapters by where they are: loaded (registered), "
            "device (in a --max-loras slot), host (weights in host memory, --max-cpu-loras).",
            labels=["model_name", "tier"])
        for tier, value in (("loaded", lora.num_loaded), ("device", lora.num_device_resident),
                            ("host", lora.num_host_resident)):
            residency.add_metric([self._model_name, tier], value)
        yield residency
