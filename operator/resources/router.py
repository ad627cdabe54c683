"""Prefix-aware routing in front of an InferenceService: ``spec.routing.router``.

- ``vllm-router``: vLLM's router (``Dockerfile.router``) as a Deployment ``<name>-router``
  with its own Service, PodDisruptionBudget and PodMonitor. It finds the engine pods with
  its Kubernetes service discovery (the engine pods' selector labels, in the service's
  namespace), for which its ServiceAccount gets a Role of exactly ``pods: get, list,
  watch`` there; ``spec.routing.vllmRouter.policy`` picks its policy (``kv_aware``, the
  default, routes on the KV-cache events every engine pod publishes; ``cache_aware``,
  ``round_robin``, ``power_of_two``, ``consistent_hash``), and
  ``sessionAffinityTTLSeconds`` gives ``kv_aware`` the router's session affinity (a
  session's later requests, by ``X-Session-ID``, stay on the pod its first one chose).
  With ``spec.disaggregation`` it runs in P/D mode (``--vllm-pd-disaggregation``): it
  discovers the prefill and the decode pool by their ``llm-d.ai/role`` label, each with
  its own policy (``prefillPolicy``, ``decodePolicy``), and its ``--kv-connector`` is the
  engines' (``nixl``).
- ``gateway``: today's InferencePool path, plus what llm-d's endpoint picker needs to
  route on the events (its precise prefix-cache scorer): the pod labels it discovers
  (``llm-d.ai/inference-serving: "true"``, ``llm-d.ai/engine-type: vllm``), the events
  on the named port ``kv-events`` with the topic ``kv@<pod IP>@<model>``, and one hash
  seed on every replica (``PYTHONHASHSEED`` and ``--prefix-caching-hash-seed``).

Either way the engine pods publish vLLM's KV events (``--kv-events-config``) on port
5557. Absent ``spec.routing.router`` the engine pods are as before (no events).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvpilot.contract.kv_transfer import PD_CONNECTORS
from kvpilot.operator import constants as c
from kvpilot.operator.contract.inference_service import ROUTER_POLICIES, ROUTERS  # noqa: F401 - re-exported
from kvpilot.operator.resources.common import Owner

ROUTER_COMPONENT = "router"
ROUTER_PORT = 8000            # the router's HTTP port in its pod
ROUTER_METRICS_PORT = 29000   # its Prometheus port (vllm-router's default)
KV_EVENTS_PORT = 5557         # vLLM's default KV-event endpoint port
KV_EVENTS_PORT_NAME = "kv-events"
LLMD_SERVING_LABEL = "llm-d.ai/inference-serving"
LLMD_ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
RBAC_API = "rbac.authorization.k8s.io/v1"
# What the router's service discovery calls: a watch of the pods in one namespace.
DISCOVERY_RULES = ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},)


@dataclass(frozen=True, slots=True)
class EngineRouting:
    """What routing adds to the engine pods: labels, container args, ports and env."""

    labels: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    ports: tuple[dict, ...] = ()
    env: tuple[dict, ...] = ()


def hash_seed(owner: Owner) -> str:
    """One prefix-hash seed per InferenceService, the same on every replica (and stable
    across restarts, so KV offloaded to disk stays valid): its namespace and name."""
    return f"{owner.namespace}/{owner.name}"


def engine_routing(owner: Owner, router: str | None, served_model: str) -> EngineRouting:
    """The engine pods' part of ``spec.routing.router`` (nothing when it is absent)."""
    if router is None:
        return EngineRouting()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              # llm-d's topic form; Kubernetes expands $(POD_IP) from the env below
              "topic": f"kv@$(POD_IP)@{served_model}"}
    seed = hash_seed(owner)
    labels = ({LLMD_SERVING_LABEL: "true", LLMD_ENGINE_TYPE_LABEL: "vllm"}
              if router == "gateway" else {})
    return EngineRouting(
        labels=labels,
        args=("--kv-events-config", json.dumps(config, separators=(",", ":")),
              "--prefix-caching-hash-seed", seed),
        ports=({"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},),
        env=({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
             # what vLLM (and a hash-compatible consumer) seeds its chain with
             {"name": "PYTHONHASHSEED",
              "value": str(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big"))}),
    )


# ---- the router's own objects -------------------------------------------------------
def router_name(owner: Owner) -> str:
    return f"{owner.name}-router"


def router_endpoint(owner: Owner) -> str:
    """The in-cluster base URL of the API behind the router (a disaggregated service's
    endpoint: a request must pass the router to reach both pools)."""
    return f"http://{router_name(owner)}.{owner.namespace}.svc.cluster.local:{c.SERVICE_HTTP_PORT}/v1"


def router_selector(owner: Owner) -> dict[str, str]:
    return {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: owner.name, c.LABEL_COMPONENT: ROUTER_COMPONENT}


def _metadata(owner: Owner) -> dict:
    return owner.metadata(ROUTER_COMPONENT, router_name(owner))


def _selector(labels: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in labels.items()]


def router_args(owner: Owner, policy: str, engine_port: int, block_size: int,
                session_affinity_ttl_s: int | None = None) -> list[str]:
    """``vllm-router`` flags: service discovery of the engine pods, the policy (with
    kv_aware's session affinity when ``session_affinity_ttl_s`` is set), metrics."""
    args = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--policy", policy,
            "--service-discovery", "--service-discovery-namespace", owner.namespace,
            "--service-discovery-port", str(engine_port),
            "--selector", *_selector(owner.selector_labels),
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT)]
    if policy == "kv_aware":
        args += ["--kv-event-block-size", str(block_size)]
        if session_affinity_ttl_s is not None:
            args += ["--kv-aware-session-affinity-ttl-secs", str(session_affinity_ttl_s)]
    return args


def pd_router_args(owner: Owner, prefill_policy: str, decode_policy: str, kv_connector: str,
                   engine_port: int) -> list[str]:
    """``vllm-router`` flags in P/D mode: each request to a prefill pod (``max_tokens=1``),
    then with the ``kv_transfer_params`` it returned to a decode pod, each pool found by its
    role label (service discovery), each with its own policy; ``kv_connector``: the
    router's name of the engines' connector (``nixl``)."""
    return ["--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--vllm-pd-disaggregation", "--kv-connector", kv_connector,
            "--prefill-policy", prefill_policy, "--decode-policy", decode_policy,
            "--service-discovery", "--service-discovery-namespace", owner.namespace,
            "--service-discovery-port", str(engine_port),
            "--prefill-selector", *_selector(owner.pool_selector("prefill")),
            "--decode-selector", *_selector(owner.pool_selector("decode")),
            "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT)]


def _probe(path: str, port: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 3}


def build_router_deployment(owner: Owner, image: str, args: list[str], replicas: int) -> dict:
    """The router Deployment running ``vllm-router args`` (non-root, read-only root
    filesystem, no service links)."""
    container = {
        "name": ROUTER_COMPONENT,
        "image": image,
        "args": args,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"}],
        "readinessProbe": _probe("/readiness", "http", 5, 3),
        "livenessProbe": _probe("/liveness", "http", 10, 6),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": router_selector(owner)},
            "template": {
                "metadata": {"labels": owner.labels(ROUTER_COMPONENT)},
                "spec": {
                    "serviceAccountName": router_name(owner),
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                },
            },
        },
    }


def build_router_service(owner: Owner) -> dict:
    """``<name>-router``: clients on port 80, scrapers on ``metrics``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {"type": "ClusterIP", "selector": router_selector(owner),
                 "ports": [{"name": "http", "port": c.SERVICE_HTTP_PORT, "targetPort": "http",
                            "protocol": "TCP"},
                           {"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics",
                            "protocol": "TCP"}]},
    }


def build_router_service_account(owner: Owner) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner),
            "automountServiceAccountToken": True}


def build_router_role(owner: Owner) -> dict:
    """Exactly what the router's service discovery calls, in the service's namespace."""
    return {"apiVersion": RBAC_API, "kind": "Role", "metadata": _metadata(owner),
            "rules": [dict(rule) for rule in DISCOVERY_RULES]}


def build_router_role_binding(owner: Owner) -> dict:
    return {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": _metadata(owner),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": router_name(owner)},
            "subjects": [{"kind": "ServiceAccount", "name": router_name(owner),
                          "namespace": owner.namespace}]}


def build_router_pdb(owner: Owner) -> dict:
    """One router pod at a time through voluntary evictions."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _metadata(owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector(owner)}}}


def build_router_podmonitor(owner: Owner, api_version: str, interval_seconds: int = 15) -> dict:
    """Scrapes the router's ``metrics`` port as the engines' PodMonitor scrapes theirs."""
    return {
        "apiVersion": api_version,
        "kind": "PodMonitor",
        "metadata": _metadata(owner),
        "spec": {"selector": {"matchLabels": router_selector(owner)},
                 "namespaceSelector": {"matchNames": [owner.namespace]},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics",
                                          "interval": f"{interval_seconds}s"}]},
    }


def router_names(owner: Owner) -> list[tuple[str, str]]:
    """(kind, name) of every child the router may have (removed when not desired)."""
    name = router_name(owner)
    return [(kind, name) for kind in ("Deployment", "Service", "ServiceAccount", "Role",
                                      "RoleBinding", "PodDisruptionBudget", "PodMonitor")]


def block_size_of(serve_args: tuple[str, ...]) -> int:
    """The engine's ``--block-size`` in the planned flags (the engine's default 16 if unset):
    kv_aware hashes requests in blocks of it."""
    args = list(serve_args)
    for i, arg in enumerate(args[:-1]):
        if arg == "--block-size":
            return int(args[i + 1])
    return 16


def router_children(owner: Owner, spec, sizing, settings, podmonitor_api: bool) -> list[dict]:
    """The router's objects for ``spec`` (``spec.routing.router: vllm-router``)."""
    from kvpilot.operator.resources.monitoring import PODMONITOR_API

    router, pools = spec.router, spec.disaggregation
    if pools is not None:   # P/D mode
        args = pd_router_args(owner, router.prefill_policy, router.decode_policy, PD_CONNECTORS[pools.kv_connector],
                              spec.port)
    else:
        args = router_args(owner, router.policy, spec.port, block_size_of(sizing.serve_args),
                           router.session_affinity_ttl_s)
    children = [build_router_service_account(owner), build_router_role(owner),
                build_router_role_binding(owner),
                build_router_deployment(owner, settings.router_image, args, router.replicas),
                build_router_service(owner)]
    if router.replicas > 1:
        children.append(build_router_pdb(owner))
    if podmonitor_api:
        children.append(build_router_podmonitor(owner, "/".join(PODMONITOR_API)))
    return children
