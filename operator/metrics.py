"""The operator's Prometheus metrics, served on ``KVPILOT_METRICS_PORT`` (0 = off).

| metric                                        | type    | labels   |
|-----------------------------------------------|---------|----------|
| ``kvpilot:operator_reconcile_passes_total``   | counter | ``result`` (``ok``, ``error``) |
| ``kvpilot:operator_child_writes_total``       | counter | ``action`` (``created``, ``patched``, ``deleted``) |

plus the process collectors (``process_*``, ``python_*``). A standby replica (kopf peering)
reconciles nothing, so its counters stay at zero.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
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
        for result in ("ok", "error"):
            self.reconcile_passes.labels(result=result)
        for action in ("created", "patched", "deleted"):
            self.child_writes.labels(action=action)

    def record_pass(self, ok: bool, writes: list[str] = ()) -> None:
        """Count one pass and its writes (``"created Deployment ns/name"`` strings)."""
        self.reconcile_passes.labels(result="ok" if ok else "error").inc()
        for write in writes:
            self.child_writes.labels(action=write.split(" ", 1)[0]).inc()


def serve_metrics(port: int, host: str = "0.0.0.0") -> OperatorMetrics:
    """A fresh registry with the process collectors, served on ``host:port``."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    metrics = OperatorMetrics(registry)
    start_http_server(port, addr=host, registry=registry)
    return metrics
