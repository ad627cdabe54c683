"""The operator's Prometheus metrics, served on ``KVPILOT_METRICS_PORT`` (0 = off).

| metric                                        | type    | labels   |
|-----------------------------------------------|---------|----------|
| ``kvpilot:operator_reconcile_passes_total``   | counter | ``result`` (``ok``, ``error``) |
| ``kvpilot:operator_child_writes_total``       | counter | ``action`` (``created``, ``patched``, ``deleted``) |
| ``kvpilot:planned_kv_blocks``                 | gauge   | ``namespace``, ``name`` (the InferenceService) |
| ``kvpilot:observed_kv_blocks``                | gauge   | ``namespace``, ``name`` |

``planned_kv_blocks`` is ``status.plan.numGpuBlocks`` (per replica); ``observed_kv_blocks``
is what the engine pod furthest from the plan reports (``status.observed.numGpuBlocks``),
absent until an engine has been read. A deleted service's series go with it.

plus the process collectors (``process_*``, ``python_*``). A standby replica (kopf peering)
reconciles nothing, so its counters stay at zero.
"""

from __future__ import annotations

import contextlib

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)


class OperatorMetrics:
    """Every Prometheus object of the operator, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.reconcile_passes = Counter(
            "kvpilot:operator_reconcile_passes", documentation="Reconcile passes of InferenceServices "
            "(on a change to one or its children, and the safety-net resync), by result: error "
            "when an API call of the pass failed",
            labelnames=["result"], registry=registry)
        self.child_writes = Counter(
            "kvpilot:operator_child_writes", documentation="Writes to child objects "
            "(Deployment, Service, ...) that a reconcile pass made, by action",
            labelnames=["action"], registry=registry)
        self.planned_kv_blocks = Gauge(
            "kvpilot:planned_kv_blocks", documentation="KV cache blocks per replica in the "
            "InferenceService's plan (status.plan.numGpuBlocks)",
            labelnames=["namespace", "name"], registry=registry)
        self.observed_kv_blocks = Gauge(
            "kvpilot:observed_kv_blocks", documentation="KV cache blocks the InferenceService's "
            "engine pod furthest from the plan reports (status.observed.numGpuBlocks)",
            labelnames=["namespace", "name"], registry=registry)
        for result in ("ok", "error"):
            self.reconcile_passes.labels(result=result)
        for action in ("created", "patched", "deleted"):
            self.child_writes.labels(action=action)

    def record_pass(self, ok: bool, writes: list[str] = ()) -> None:
        """Count one pass and its writes (``"created Deployment ns/name"`` strings)."""
        self.reconcile_passes.labels(result="ok" if ok else "error").inc()
        for write in writes:
            self.child_writes.labels(action=write.split(" ", 1)[0]).inc()


    def record_sizing(self, namespace: str, name: str, planned: int | None, observed: int | None) -> None:
        """Set (or, for None, remove) one service's planned and observed KV blocks."""
        for gauge, value in ((self.planned_kv_blocks, planned), (self.observed_kv_blocks, observed)):
            if value is not None:
                gauge.labels(namespace=namespace, name=name).set(value)
            else:
                _remove(gauge, namespace, name)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted service's series."""
        self.record_sizing(namespace, name, None, None)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set
        gauge.remove(*labels)


def serve_metrics(port: int, host: str = "0.0.0.0") -> OperatorMetrics:
    """A fresh registry with the process collectors, served on ``host:port``."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    metrics = OperatorMetrics(registry)
    start_http_server(port, addr=host, registry=registry)
    return metrics
