"""Prometheus-operator objects of a service (built when monitoring.coreos.com/v1 is served):
the PodMonitor scraping its engine pods, and the PrometheusRule alerting on its declared
latency SLOs."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal

from kvpilot.operator.resources.common import Owner

PODMONITOR_API = ("monitoring.coreos.com", "v1")


def build_podmonitor(owner: Owner, interval_seconds: int = 15) -> dict:
    """Scrape ``/metrics`` on the pods' ``http`` port every ``interval_seconds``."""
    return {
        "apiVersion": "/".join(PODMONITOR_API),
        "kind": "PodMonitor",
        "metadata": owner.metadata("monitoring"),
        "spec": {
            "selector": {"matchLabels": owner.selector_labels},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics",
                                     "interval": f"{interval_seconds}s"}],
        },
    }


# (SLO field, vLLM histogram, alert name, what it measures) of the per-service SLO alerts.
SLO_ALERTS = (
    ("ttftP95Ms", "vllm:time_to_first_token_seconds", "KVPilotTTFTAboveSLO", "time to first token"),
    ("itlP95Ms", "vllm:inter_token_latency_seconds", "KVPilotITLAboveSLO", "inter-token latency"),
)
SLO_WINDOW = "5m"
SLO_FOR = "5m"


def seconds_from_ms(ms: float) -> str:
    """``ms`` milliseconds as an exact decimal number of seconds (``250`` -> ``"0.25"``):
    the threshold in the rule is the declared SLO, with no binary rounding."""
    value = Decimal(repr(float(ms))) / 1000
    return format(value.normalize(), "f")


def build_slo_prometheusrule(owner: Owner, model_name: str, slo: Mapping[str, float | None]) -> dict | None:
    """Alerts when the service's p95 time to first token / inter-token latency over
    ``SLO_WINDOW`` exceeds its declared ``spec.slo.ttftP95Ms`` / ``itlP95Ms``; None when
    the spec declares neither.

    Args:
        owner: the InferenceService.
        model_name: the engines' ``model_name`` label (the served model name).
        slo: the spec's SLO fields by their CRD names (``ttftP95Ms``, ``itlP95Ms``).
    """
    selector = f'namespace="{owner.namespace}",model_name="{model_name}"'
    rules = []
    for field, histogram, alert, what in SLO_ALERTS:
        ms = slo.get(field)
        if ms is None:
            continue
        threshold = seconds_from_ms(ms)
        quantile = (f"histogram_quantile(0.95, sum by (le) "
                    f"(rate({histogram}_bucket{{{selector}}}[{SLO_WINDOW}])))")
        rules.append({
            "alert": alert,
            "expr": f"{quantile} > {threshold}",
            "for": SLO_FOR,
            "labels": {"severity": "warning", "namespace": owner.namespace,
                       "inferenceservice": owner.name, "model_name": model_name, "slo": field},
            "annotations": {
                "summary": f"p95 {what} of {owner.namespace}/{owner.name} is above its SLO "
                           f"(spec.slo.{field}: {threshold} s).",
                "description": f"The 95th percentile of {histogram} over {SLO_WINDOW} has "
                               f"exceeded {threshold} s for {SLO_FOR}.",
            },
        })
    if not rules:
        return None
    return {
        "apiVersion": "/".join(PODMONITOR_API),
        "kind": "PrometheusRule",
        "metadata": owner.metadata("alerts"),
        "spec": {"groups": [{"name": f"kvpilot-slo.{owner.namespace}.{owner.name}", "rules": rules}]},
    }
