"""The operator's Prometheus metrics, served on ``KVPILOT_METRICS_BIND_ADDRESS`` (default
127.0.0.1: only the host or pod itself) port ``KVPILOT_METRICS_PORT`` (0 = off).

| metric                                        | type    | labels   |
|-----------------------------------------------|---------|----------|
| ``kvpilot:operator_reconcile_passes_total``   | counter | ``result`` (``ok``, ``error``) |
| ``kvpilot:operator_child_writes_total``       | counter | ``action`` (``created``, ``patched``, ``deleted``) |
| ``kvpilot:planned_kv_blocks``                 | gauge   | ``namespace``, ``name`` (the InferenceService) |
| ``kvpilot:observed_kv_blocks``                | gauge   | ``namespace``, ``name`` |
| ``kvpilot:operator_plan_outcomes_total``      | counter | ``outcome`` (``feasible``, ``infeasible``), ``reason`` (the Planned condition's: an infeasible plan's binding constraint) |
| ``kvpilot:inferenceservice_replicas``         | gauge   | ``namespace``, ``name``, ``model_name`` |
| ``kvpilot:inferenceservice_desired_replicas`` | gauge   | ``namespace``, ``name``, ``model_name`` |
| ``kvpilot:inferenceservice_max_replicas``     | gauge   | ``namespace``, ``name``, ``model_name`` |
| ``kvpilot:inferenceservice_sizing_drift``     | gauge   | ``namespace``, ``name``, ``model_name`` |

``planned_kv_blocks`` is ``status.plan.numGpuBlocks`` (per replica); ``observed_kv_blocks``
is what the engine pod furthest from the plan reports (``status.observed.numGpuBlocks``),
absent until an engine has been read. The ``inferenceservice_*`` gauges: the Deployment's
``status.replicas`` and ``spec.replicas`` (what the autoscaler asks for), the autoscaler's
ceiling (else the fixed count) and 1 while SizingDrift is True; ``model_name`` (the served
name) joins them with the engines' series. A deleted service's series go with it.

plus the process collectors (``process_*``, ``python_*``). A standby replica (kopf peering)
reconciles nothing, so its counters stay at zero.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
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
        self.plan_outcomes = Counter(
            "kvpilot:operator_plan_outcomes", documentation="Reconcile passes by the plan's outcome "
            "(feasible, infeasible) and the Planned condition's reason (for an infeasible plan, "
            "its binding constraint)", labelnames=["outcome", "reason"], registry=registry)
        service_labels = ["namespace", "name", "model_name"]
        self.service_gauges = {
            field: Gauge(f"kvpilot:inferenceservice_{metric}", documentation=doc,
                         labelnames=service_labels, registry=registry)
            for field, metric, doc in (
                ("replicas", "replicas", "Replicas of the service's Deployment (status.replicas)"),
                ("desired_replicas", "desired_replicas", "Replicas the service's Deployment asks "
                 "for (spec.replicas: the autoscaler's decision when autoscaled)"),
                ("max_replicas", "max_replicas", "The most replicas the service may run "
                 "(the autoscaler's ceiling, else the fixed count)"),
                ("sizing_drift", "sizing_drift", "1 while the service's SizingDrift condition is "
                 "True (observed KV capacity off the plan), else 0"),
            )}
        self._service_keys: dict[tuple[str, str], tuple[str, str, str]] = {}
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

    def record_service(self, namespace: str, name: str, figures) -> None:
        """Count the pass's plan outcome and set the service's gauges from ``figures``
        (a ``ServiceFigures``)."""
        self.plan_outcomes.labels(outcome=figures.plan_outcome, reason=figures.plan_reason).inc()
        key = (namespace, name, figures.model_name or "")
        if self._service_keys.get((namespace, name), key) != key:   # the served name changed
            self._forget_service(namespace, name)
        self._service_keys[(namespace, name)] = key
        values = {"replicas": figures.replicas, "desired_replicas": figures.desired_replicas,
                  "max_replicas": figures.max_replicas,
                  "sizing_drift": None if figures.sizing_drift is None else int(figures.sizing_drift)}
        for field, gauge in self.service_gauges.items():
            if values[field] is None:
                _remove(gauge, *key)
            else:
                gauge.labels(*key).set(values[field])

    def _forget_service(self, namespace: str, name: str) -> None:
        key = self._service_keys.pop((namespace, name), None)
        if key is not None:
            for gauge in self.service_gauges.values():
                _remove(gauge, *key)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted service's series."""
        self.record_sizing(namespace, name, None, None)
        self._forget_service(namespace, name)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set
        gauge.remove(*labels)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # no access log line per scrape
        pass


def plain_text_app(registry: CollectorRegistry):
    """The registry's WSGI app, always answering in the text format (0.0.4).

    NOTE: asked for OpenMetrics (Prometheus asks for it first), prometheus_client 0.2x
    escapes the colons of metric names to underscores (``kvpilot:planned_kv_blocks``
    would be stored as ``kvpilot_planned_kv_blocks``); the text format keeps the names,
    as the engines' /metrics does.
    """
    app = make_wsgi_app(registry)

    def plain(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}, start_response)
    return plain


def serve_metrics(port: int, host: str = "127.0.0.1") -> OperatorMetrics:
    """A fresh registry with the process collectors, served on ``host:port`` (``host``: an
    IPv4 or IPv6 address; 0.0.0.0 or :: for every interface)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    metrics = OperatorMetrics(registry)
    server_class = _ThreadingServer6 if ipaddress.ip_address(host).version == 6 else _ThreadingServer
    server = make_server(host, port, plain_text_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="kvpilot-metrics", daemon=True).start()
    return metrics
