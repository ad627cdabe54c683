"""``spec.routing.router``: vLLM's router in front of the engines, or llm-d's labels on them.

Oracles: kubernetes-validate (strict) for every built-in kind, the real ``kvpilot serve``
parser for the engine's new flags, and vllm-router's own argument parser for the router's
(when the router is installed)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser
from kvpilot.operator import constants as c
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.router import DISCOVERY_RULES, KV_EVENTS_PORT, hash_seed
from kvpilot.operator.spec import SpecError, parse_spec

from support.built import SMALL, build

K8S_VERSION = "1.33"
ROUTED = {**SMALL, "replicas": 3, "routing": {"router": "vllm-router"}}


def _by(children, kind: str, name: str):
    return next(ch.body for ch in children if ch.kind.kind == kind and ch.name == name)


def _engine_container(children) -> dict:
    return _by(children, "Deployment", "svc")["spec"]["template"]["spec"]["containers"][0]


def test_vllm_router_children_are_valid_and_wired_to_the_engine_pods():
    children = build(ROUTED, podmonitor_api=True)
    names = {(ch.kind.kind, ch.name) for ch in children}
    for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget",
                 "PodMonitor"):
        assert (kind, "svc-router") in names
    for child in children:
        if child.kind.kind != "PodMonitor":
            assert kubernetes_validate.validate(child.body, K8S_VERSION, strict=True) == K8S_VERSION
    engine_service = _by(children, "Service", "svc")
    router = _by(children, "Deployment", "svc-router")
    pod = router["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    # Discovery selects exactly the pods the engine Service selects, in the service's namespace.
    selector = args[args.index("--selector") + 1:args.index("--prometheus-host")]
    assert dict(s.split("=", 1) for s in selector) == engine_service["spec"]["selector"]
    assert args[args.index("--service-discovery-namespace") + 1] == "serving"
    assert args[args.index("--service-discovery-port") + 1] == str(8000)
    assert args[args.index("--policy") + 1] == "kv_aware"
    # The router's Service selects the router pods (and not the engines).
    router_service = _by(children, "Service", "svc-router")
    labels = pod["metadata"]["labels"]
    assert all(labels[k] == v for k, v in router_service["spec"]["selector"].items())
    assert router_service["spec"]["selector"] != engine_service["spec"]["selector"]
    assert router["spec"]["selector"]["matchLabels"] == router_service["spec"]["selector"]
    # Its identity may do exactly what discovery does, in this namespace only.
    assert pod["spec"]["serviceAccountName"] == "svc-router"
    role = _by(children, "Role", "svc-router")
    assert role["rules"] == [dict(r) for r in DISCOVERY_RULES] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = _by(children, "RoleBinding", "svc-router")
    assert binding["roleRef"]["name"] == "svc-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "svc-router", "namespace": "serving"}]
    monitor = _by(children, "PodMonitor", "svc-router")
    assert monitor["spec"]["selector"]["matchLabels"] == router_service["spec"]["selector"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_engines_publish_kv_events_the_router_reads():
    container = _engine_container(build(ROUTED))
    ns = make_serve_parser().parse_args(container["args"])
    events = engine_args_from_namespace(ns).kv_events_config
    assert events.enabled and events.endpoint == f"tcp://*:{KV_EVENTS_PORT}"
    assert events.topic == "kv@$(POD_IP)@svc"          # the served model; Kubernetes expands $(POD_IP)
    assert {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert ns.prefix_caching_hash_seed == hash_seed(Owner("svc", "serving"))


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two", "consistent_hash"])
def test_policy_is_selectable(policy):
    spec = {**ROUTED, "routing": {"router": "vllm-router", "vllmRouter": {"policy": policy, "replicas": 1}}}
    children = build(spec)
    args = _by(children, "Deployment", "svc-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == policy
    assert "--kv-event-block-size" not in args
    assert not any(ch.kind.kind == "PodDisruptionBudget" and ch.name == "svc-router" for ch in children)


def test_gateway_keeps_the_inference_pool_and_labels_pods_for_llm_d():
    children = build({**SMALL, "routing": {"router": "gateway"}}, inference_pool_api=True)
    pool = _by(children, "InferencePool", "svc")
    template = _by(children, "Deployment", "svc")["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert labels["llm-d.ai/inference-serving"] == "true" and labels["llm-d.ai/engine-type"] == "vllm"
    assert all(labels[k] == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    container = template["spec"]["containers"][0]
    assert any(p["name"] == "kv-events" for p in container["ports"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PYTHONHASHSEED"].isdigit() and 0 <= int(env["PYTHONHASHSEED"]) < 2**32
    assert not any(ch.name == "svc-router" for ch in children)
    assert kubernetes_validate.validate(_by(children, "Deployment", "svc"), K8S_VERSION, strict=True)


def test_without_a_router_the_engines_are_as_before():
    container = _engine_container(build(SMALL))
    assert "--kv-events-config" not in container["args"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert c.LABEL_COMPONENT in _by(build(SMALL), "Deployment", "svc")["spec"]["template"]["metadata"]["labels"]


def test_kv_aware_session_affinity_is_the_routers_flag():
    routing = {"router": "vllm-router", "vllmRouter": {"sessionAffinityTTLSeconds": 600}}
    args = _by(build({**ROUTED, "routing": routing}), "Deployment", "svc-router")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "kv_aware"
    assert args[args.index("--kv-aware-session-affinity-ttl-secs") + 1] == "600"
    plain = _by(build(ROUTED), "Deployment", "svc-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kv-aware-session-affinity-ttl-secs" not in plain


@pytest.mark.parametrize("routing, message", [
    ({"router": "nginx"}, "spec.routing.router must be one of"),
    ({"router": "vllm-router", "vllmRouter": {"policy": "random"}}, "policy must be one of"),
    ({"router": "vllm-router", "vllmRouter": {"replicas": 0}}, "replicas"),
    ({"router": "vllm-router", "vllmRouter": {"policy": "cache_aware", "sessionAffinityTTLSeconds": 60}},
     "sessionAffinityTTLSeconds applies to the kv_aware policy only"),
    ({"router": "vllm-router", "vllmRouter": {"sessionAffinityTTLSeconds": 0}}, "sessionAffinityTTLSeconds"),
])
def test_bad_router_specs_are_refused(routing, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({**SMALL, "routing": routing}, "svc")


def test_the_router_accepts_its_arguments():
    """vllm-router's own parser, when it is installed (a benchmark-only tool here)."""
    launch = pytest.importorskip("vllm_router.launch_router")
    args = _by(build(ROUTED), "Deployment", "svc-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = launch.parse_router_args(args)
    assert (parsed.policy, parsed.service_discovery, parsed.service_discovery_namespace) == \
        ("kv_aware", True, "serving")
    assert parsed.selector == {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: "svc",
                               c.LABEL_COMPONENT: "engine"}
    assert parsed.kv_event_block_size == 16 and parsed.prometheus_port == 29000
    affinity = {"router": "vllm-router", "vllmRouter": {"sessionAffinityTTLSeconds": 600}}
    args = _by(build({**ROUTED, "routing": affinity}), "Deployment", "svc-router")[
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert launch.parse_router_args(args).kv_aware_session_affinity_ttl_secs == 600


def _admitted_ports(policy: dict, pod_labels: dict) -> set[int]:
    """The ports a pod of ``pod_labels`` in the policy's namespace may reach on the engine pods
    (NetworkPolicy semantics for same-namespace pod selectors)."""
    ports: set[int] = set()
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            selector = peer.get("podSelector")
            if selector is None or "namespaceSelector" in peer or "ipBlock" in peer:
                continue
            if all(pod_labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
                ports |= {p["port"] for p in rule["ports"]} if "ports" in rule else {-1}
    return ports


def test_the_engine_fence_lets_the_router_in_to_the_api_and_the_kv_events():
    children = build(ROUTED)
    router_pod = _by(children, "Deployment", "svc-router")["spec"]["template"]["metadata"]["labels"]
    fence = _by(children, "NetworkPolicy", "svc")
    assert _admitted_ports(fence, router_pod) == {8000, KV_EVENTS_PORT}
    assert _admitted_ports(fence, {"app": "stranger"}) == set()
    # without a router, the events port is not opened
    plain = _by(build(SMALL), "NetworkPolicy", "svc")
    assert KV_EVENTS_PORT not in {p["port"] for r in plain["spec"]["ingress"] for p in r.get("ports", ())}
