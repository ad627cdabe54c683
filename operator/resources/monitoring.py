"""A Prometheus-operator PodMonitor for the engine pods (built when its API exists)."""

from __future__ import annotations

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
