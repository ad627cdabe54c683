"""The Service in front of the engine pods: ``http`` for clients, ``metrics`` for scrapers."""

from __future__ import annotations

from kvpilot.operator import constants as c
from kvpilot.operator.resources.common import Owner


def build_service(owner: Owner) -> dict:
    """A ClusterIP Service selecting ``owner``'s engine pods.

    The engine serves its API and ``/metrics`` on one port; the Service names it twice so
    that clients use port 80 and a ServiceMonitor/scraper can target ``metrics``.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata("service"),
        "spec": {
            "type": "ClusterIP",
            "selector": owner.selector_labels,
            "ports": [
                {"name": "http", "port": c.SERVICE_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": c.SERVICE_METRICS_PORT, "targetPort": "http",
                 "protocol": "TCP"},
            ],
        },
    }


def endpoint(owner: Owner) -> str:
    """The in-cluster base URL of the OpenAI-compatible API."""
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{c.SERVICE_HTTP_PORT}/v1"
