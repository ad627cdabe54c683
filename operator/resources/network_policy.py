"""The NetworkPolicy that fences one InferenceService's engine pods (``security.NetworkFence``).

Ingress: the engine port from the client pods (the gateway, the router / endpoint
picker: ``client_pod_labels``, in the service's namespace unless namespace labels are
set), from the monitoring namespace and from the operator's pods (it reads ``/metrics``),
and with ``spec.routing.router`` the KV-events port too (from the operator's own router pods
as well, for ``vllm-router``);
any port from the service's own pods (its peers). Egress: DNS to the cluster DNS pods, the
service's peers, and, only where the spec needs them, the model source (hf:// and s3://
downloads) and an LMCache remote server, on their ports to ``model_egress_cidrs``. A
NetworkPolicy selecting a pod denies whatever no rule allows, in both directions.
"""

from __future__ import annotations

from kvpilot.operator.constants import LABEL_COMPONENT
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.router import KV_EVENTS_PORT, router_selector
from kvpilot.operator.security import NetworkFence
from kvpilot.operator.spec import InferenceServiceSpec

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"   # set by the API server on every namespace
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "operator"}
DNS_PORT = 53


def _in_namespace(name: str, pod_labels: dict | None = None) -> dict:
    peer: dict = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: name}}}
    if pod_labels:
        peer["podSelector"] = {"matchLabels": dict(pod_labels)}
    return peer


def _egress_ports(spec: InferenceServiceSpec, fence: NetworkFence) -> list[int]:
    """The ports the pods must reach outside the cluster for this spec (none: no rule)."""
    ports: list[int] = []
    if spec.model.scheme in ("hf", "s3"):
        ports += fence.model_egress_ports
    url = spec.offload.lmcache_remote_url
    if url and spec.offload.enabled:
        ports.append(int(url.rpartition(":")[2]))
    return sorted(set(ports))


def _engine_pods(owner: Owner, more_components: tuple[str, ...]) -> dict:
    """The fenced pods: the engine pods, and a group's workers (``more_components``)."""
    if not more_components:
        return {"matchLabels": owner.selector_labels}
    labels = {k: v for k, v in owner.selector_labels.items() if k != LABEL_COMPONENT}
    engine = owner.selector_labels[LABEL_COMPONENT]
    return {"matchLabels": labels, "matchExpressions": [
        {"key": LABEL_COMPONENT, "operator": "In", "values": [engine, *more_components]}]}


def build_network_policy(owner: Owner, spec: InferenceServiceSpec, fence: NetworkFence,
                         more_components: tuple[str, ...] = ()) -> dict:
    """The engine pods' NetworkPolicy (see the module docstring for what it allows);
    ``more_components``: further pods of the service fenced with them and peers of them
    (a LeaderWorkerSet's workers)."""
    clients: dict = {"podSelector": {"matchLabels": dict(fence.client_pod_labels)}}
    if fence.client_namespace_labels is not None:
        clients["namespaceSelector"] = {"matchLabels": dict(fence.client_namespace_labels)}
    sources = [clients]
    if fence.monitoring_namespace:
        sources.append(_in_namespace(fence.monitoring_namespace))
    if fence.operator_namespace:
        sources.append(_in_namespace(fence.operator_namespace, OPERATOR_POD_LABELS))
    ingress_ports = [spec.port]
    if spec.router.kind is not None:   # the routers read the pods' KV-cache events too
        ingress_ports.append(KV_EVENTS_PORT)
    if spec.router.kind == "vllm-router":   # the operator's own router, whatever the client labels
        sources.append({"podSelector": {"matchLabels": router_selector(owner)}})
    pods = _engine_pods(owner, more_components)
    peers = {"podSelector": pods}
    egress = [
        {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(fence.dns_pod_labels)}}],
         "ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]},
        {"to": [peers]},
    ]
    if ports := _egress_ports(spec, fence):
        egress.append({"to": [{"ipBlock": {"cidr": cidr}} for cidr in fence.model_egress_cidrs],
                       "ports": [{"protocol": "TCP", "port": p} for p in ports]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owner.metadata("network-policy"),
        "spec": {
            "podSelector": pods,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": sources, "ports": [{"protocol": "TCP", "port": p} for p in ingress_ports]},
                        {"from": [peers]}],
            "egress": egress,
        },
    }
