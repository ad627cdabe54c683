"""``spec.disaggregation``: a prefill and a decode pool behind vLLM's router in P/D mode.

Oracles: kubernetes-validate (strict, Kubernetes 1.33) for every built-in kind, the CRD's
openAPIV3Schema (jsonschema) and its CEL rules (cel-python) for what the API server admits,
the real ``kvpilot serve`` parser for each pool's flags (``--kv-transfer-config`` included),
vllm-router's own argument parser for the router's, and promtool for the autoscalers' PromQL.
"""

from __future__ import annotations

import copy
import re
import subprocess

import kopf
import kubernetes_validate
import pytest
import yaml

from kvpilot.contract.kv_transfer import (
    DEFAULT_NIXL_SIDE_CHANNEL_PORT,
    KV_CONSUMER,
    KV_PRODUCER,
    NIXL_CONNECTOR,
    NIXL_SIDE_CHANNEL_HOST_ENV,
    NIXL_SIDE_CHANNEL_PORT_ENV,
)
from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator import constants as c
from kvpilot.operator.resources import desired_children, possible_children
from kvpilot.operator.resources.common import ROLE_LABEL, Owner
from kvpilot.operator.resources.pools import pool_queries
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec_to_plan import plan_service

from support import crd_schema
from support.chart import tool

K8S_VERSION = "1.33"
SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")
SCHEMA = crd_schema.version_schema(crd_schema.load_crd())
(EXAMPLE,) = crd_schema.DISAGGREGATED
BUILTIN = {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler", "PodDisruptionBudget",
           "ServiceAccount", "NetworkPolicy", "Role", "RoleBinding"}
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
PD = {**SMALL, "routing": {"router": "vllm-router"}, "disaggregation": {"prefill": {}, "decode": {}}}


def _cr(spec: dict, name: str = "rag") -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": name, "namespace": "serving", "uid": f"uid-{name}"}, "spec": spec}


def _example() -> dict:
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"].update(namespace="serving", uid="uid-rag")
    return cr


def _build(cr: dict, **apis) -> dict[tuple[str, str], dict]:
    """(kind, name) -> body of the children, stamped by kopf.adopt as the operator does."""
    spec = parse_spec(cr["spec"], cr["metadata"]["name"])
    outcome = plan_service(spec)
    assert outcome.feasible, outcome.message
    owner = Owner(cr["metadata"]["name"], "serving", cr["metadata"]["uid"])
    children = desired_children(owner, spec, outcome.sizing, SETTINGS, podmonitor_api=apis.get("podmonitor", True),
                                inference_pool_api=True, keda_api=apis.get("keda", True))
    for child in children:
        kopf.adopt(child.body, owner=cr)
    out = {(ch.kind.kind, ch.name): ch.body for ch in children}
    assert len(out) == len(children)
    return out


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_the_example_renders_both_pools_and_the_router_in_pd_mode_strict_valid():
    cr = _example()
    children = _build(cr)
    name = cr["metadata"]["name"]
    assert set(children) == {
        ("ServiceAccount", f"{name}-engine"), ("Deployment", f"{name}-prefill"), ("Deployment", f"{name}-decode"),
        ("ScaledObject", f"{name}-prefill"), ("HorizontalPodAutoscaler", f"{name}-decode"),
        ("PodDisruptionBudget", f"{name}-prefill"), ("PodDisruptionBudget", f"{name}-decode"),
        ("Service", name), ("NetworkPolicy", name), ("PodMonitor", name), ("PrometheusRule", name),
        ("ServiceAccount", f"{name}-router"), ("Role", f"{name}-router"), ("RoleBinding", f"{name}-router"),
        ("Deployment", f"{name}-router"), ("Service", f"{name}-router"), ("PodDisruptionBudget", f"{name}-router"),
        ("PodMonitor", f"{name}-router")}
    # no engine Deployment of the plain layout, no InferencePool (it would route around P/D)
    assert ("Deployment", name) not in children and not any(k == "InferencePool" for k, _ in children)
    for (kind, _), body in children.items():
        if kind in BUILTIN:
            assert kubernetes_validate.validate(body, K8S_VERSION, strict=True) == K8S_VERSION
        else:
            assert kind in ("PodMonitor", "PrometheusRule", "ScaledObject")
        assert body["metadata"]["labels"][c.LABEL_INSTANCE] == name
        (ref,) = body["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (c.KIND, "uid-rag", True)
    # every child the pools may have is one the operator removes when it is no longer wanted
    possible = {(kind.kind, child) for kind, child in possible_children(Owner(name, "serving"))}
    assert set(children) <= possible


@pytest.mark.parametrize("role, kv_role", [("prefill", KV_PRODUCER), ("decode", KV_CONSUMER)])
def test_each_pool_runs_its_kv_role_and_the_pools_plan(role, kv_role):
    cr = _example()
    children = _build(cr)
    outcome = plan_service(parse_spec(cr["spec"], "qwen3-8b-rag"))
    pools = outcome.sizing.status["disaggregation"]
    deployment = children[("Deployment", f"qwen3-8b-rag-{role}")]
    container = _container(deployment)
    ns = make_serve_parser().parse_args(container["args"])     # the engine's own parser
    config = ns.kv_transfer_config
    assert (config.kv_connector, config.kv_role) == (NIXL_CONNECTOR, kv_role)
    assert config.is_kv_producer == (role == "prefill") and config.is_kv_consumer == (role == "decode")
    plan = pools[role]
    args, run = container["args"], plan["serveArgs"]
    assert any(args[i:i + len(run)] == run for i in range(len(args))), (args, run)   # the planned flags, in order
    assert (ns.max_num_seqs, ns.max_num_batched_tokens) == (plan["maxNumSeqs"], plan["maxNumBatchedTokens"])
    assert ns.kv_cache_memory_bytes == plan["kvCacheMemoryBytes"]
    # replicas: the planner's ratio inside the pool's autoscaler bounds (prefill 7 in [4, 12],
    # decode 2 in [2, 6]); the autoscaler owns the count after creation
    assert deployment["spec"]["replicas"] == plan["replicas"] == {"prefill": 7, "decode": 2}[role]
    assert plan["plannedReplicas"] == {"prefill": 7, "decode": 2}[role] and pools["ratio"] == "7:2"
    # the pool's pods: llm-d's role label, selected by their Deployment only
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[ROLE_LABEL] == role and labels[c.LABEL_COMPONENT] == "engine"
    assert deployment["spec"]["selector"]["matchLabels"] == {**Owner("qwen3-8b-rag", "serving").selector_labels,
                                                             ROLE_LABEL: role}
    other = children[("Deployment", f"qwen3-8b-rag-{'decode' if role == 'prefill' else 'prefill'}")]
    assert not _matches(deployment["spec"]["selector"]["matchLabels"], other["spec"]["template"]["metadata"]["labels"])
    # NIXL's side channel: the pod IP a peer dials, and the port, on the container
    env = {e["name"]: e for e in container["env"]}
    assert env[NIXL_SIDE_CHANNEL_HOST_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[NIXL_SIDE_CHANNEL_PORT_ENV]["value"] == str(DEFAULT_NIXL_SIDE_CHANNEL_PORT)
    assert {"name": "nixl", "containerPort": DEFAULT_NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"} in container["ports"]
    if role == "decode":   # the pool's own resources over the service's
        assert container["resources"]["requests"]["cpu"] == "8"


def test_the_service_fence_and_monitoring_see_both_pools_and_the_pools_reach_each_other():
    children = _build(_example())
    pools = [children[("Deployment", f"qwen3-8b-rag-{r}")]["spec"]["template"]["metadata"]["labels"]
             for r in ("prefill", "decode")]
    service = children[("Service", "qwen3-8b-rag")]
    fence = children[("NetworkPolicy", "qwen3-8b-rag")]["spec"]
    monitor = children[("PodMonitor", "qwen3-8b-rag")]["spec"]
    for labels in pools:
        assert _matches(service["spec"]["selector"], labels)
        assert _matches(fence["podSelector"]["matchLabels"], labels)
        assert _matches(monitor["selector"]["matchLabels"], labels)
    # peers: any port from the service's own pods, so the decode pods reach the prefill pods'
    # side channel and NIXL's transfer ports in both directions
    (peers,) = [rule for rule in fence["ingress"] if "ports" not in rule]
    assert peers["from"] == [{"podSelector": fence["podSelector"]}]
    assert {"to": [{"podSelector": fence["podSelector"]}]} in fence["egress"]


def test_the_router_runs_in_pd_mode_on_the_pools_role_labels():
    children = _build(_example())
    router = children[("Deployment", "qwen3-8b-rag-router")]
    args = _container(router)["args"]
    assert "--vllm-pd-disaggregation" in args and args[args.index("--kv-connector") + 1] == "nixl"
    assert "--policy" not in args      # each pool has its own
    launch = pytest.importorskip("vllm_router.launch_router")
    parsed = launch.parse_router_args(args)
    assert parsed.vllm_pd_disaggregation and parsed.service_discovery and parsed.kv_connector == "nixl"
    assert (parsed.prefill_policy, parsed.decode_policy) == ("cache_aware", "power_of_two")
    assert parsed.service_discovery_namespace == "serving" and parsed.service_discovery_port == 8000
    parsed._validate_router_args()     # P/D with discovery needs no --prefill / --decode URLs
    for role, selector in (("prefill", parsed.prefill_selector), ("decode", parsed.decode_selector)):
        pool = children[("Deployment", f"qwen3-8b-rag-{role}")]
        assert selector == pool["spec"]["selector"]["matchLabels"]
        assert _matches(selector, pool["spec"]["template"]["metadata"]["labels"])
    assert parsed.prefill_selector != parsed.decode_selector
    assert children[("Role", "qwen3-8b-rag-router")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_each_pool_scales_on_its_own_signals(tmp_path):
    cr = _example()
    children = _build(cr)
    hpa = children[("HorizontalPodAutoscaler", "qwen3-8b-rag-decode")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen3-8b-rag-decode"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["metrics"]} == {
        SETTINGS.hpa_kv_usage_metric: "750m", SETTINGS.hpa_preemption_metric: "100m"}
    keda = children[("ScaledObject", "qwen3-8b-rag-prefill")]["spec"]
    assert keda["scaleTargetRef"]["name"] == "qwen3-8b-rag-prefill"
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (4, 12)
    triggers = [(t["metricType"], t["metadata"]["threshold"]) for t in keda["triggers"]]
    assert triggers == [("AverageValue", "4"), ("Value", "0.5")]     # queue per pod; p95 TTFT 500 ms
    # the queries select the pool's pods by the names its ReplicaSets give them (PromQL anchors regexes)
    spec = parse_spec(cr["spec"], "qwen3-8b-rag")
    owner = Owner("qwen3-8b-rag", "serving")
    queries = [q for role in ("prefill", "decode") for q, _, _ in pool_queries(owner, spec, role)]
    pattern = re.search(r'pod=~"([^"]+)"', queries[0]).group(1)
    assert re.fullmatch(pattern, "qwen3-8b-rag-prefill-5d9f8c7b6-x2x7k")
    for other in ("qwen3-8b-rag-decode-5d9f8c7b6-x2x7k", "qwen3-8b-rag-prefill-x-5d9f8c7b6-x2x7k"):
        assert not re.fullmatch(pattern, other)
    rules = tmp_path / "queries.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "pools", "rules": [
        {"record": f"kvpilot:pool_{i}", "expr": q} for i, q in enumerate(queries)]}]}))
    run = subprocess.run([tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True)
    assert run.returncode == 0 and f"{len(queries)} rules found" in run.stdout, run.stdout + run.stderr
    # an HPA prefill pool: its queue, and its pods' p95 TTFT against the SLO's target
    hpa_spec = copy.deepcopy(cr["spec"])
    hpa_spec["disaggregation"]["prefill"]["autoscaling"]["mode"] = "hpa"
    prefill = _build(_cr(hpa_spec))[("HorizontalPodAutoscaler", "rag-prefill")]["spec"]
    assert {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in prefill["metrics"]} == {
        SETTINGS.hpa_waiting_metric: "4", SETTINGS.hpa_ttft_metric: "500m"}


def test_pinned_pools_without_autoscalers_own_their_counts():
    spec = {**PD, "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 3}}}
    children = _build(_cr(spec), podmonitor=False)
    assert children[("Deployment", "rag-prefill")]["spec"]["replicas"] == 1
    assert children[("Deployment", "rag-decode")]["spec"]["replicas"] == 3
    assert ("PodDisruptionBudget", "rag-decode") in children and ("PodDisruptionBudget", "rag-prefill") not in children
    assert not any(kind in ("HorizontalPodAutoscaler", "ScaledObject") for kind, _ in children)


def _admitted_errors(spec: dict) -> list[str]:
    return crd_schema.admit(SCHEMA, _cr(spec))[1]


# (case, spec, a phrase of the API server's message and of the operator's)
BAD = [
    ("spec.replicas beside the pools", {**PD, "replicas": 2}, "sizes its two pools"),
    ("a service autoscaler beside the pools", {**PD, "autoscaling": {"mode": "hpa", "maxReplicas": 3}},
     "sizes its two pools"),
    ("no router", {k: v for k, v in PD.items() if k != "routing"}, "needs routing.router: vllm-router"),
    ("the gateway instead", {**PD, "routing": {"router": "gateway"}}, "needs routing.router: vllm-router"),
    ("P/D policies without pools", {**SMALL, "routing": {"router": "vllm-router",
                                                         "vllmRouter": {"decodePolicy": "round_robin"}}},
     "need spec.disaggregation"),
    ("kv_aware among the pools", {**PD, "routing": {"router": "vllm-router", "vllmRouter": {"prefillPolicy": "kv_aware"}}},
     "prefillPolicy"),
    ("session affinity in P/D mode", {**PD, "routing": {"router": "vllm-router",
                                                        "vllmRouter": {"sessionAffinityTTLSeconds": 60}}},
     "not used in P/D mode"),
    ("a pool's replicas beside its autoscaler",
     {**PD, "disaggregation": {"prefill": {"replicas": 2, "autoscaling": {"mode": "keda", "maxReplicas": 4}},
                               "decode": {}}}, "prefill.replicas is not used"),
    ("a pool autoscaler without a ceiling", {**PD, "disaggregation": {"prefill": {},
                                                                      "decode": {"autoscaling": {"mode": "hpa"}}}},
     "decode.autoscaling.maxReplicas is required"),
    ("a pool scaled to zero", {**PD, "disaggregation": {"prefill": {}, "decode": {
        "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 2}}}}, "minReplicas"),
    ("a pool of zero replicas", {**PD, "disaggregation": {"prefill": {"replicas": 0}, "decode": {}}}, "replicas"),
    ("a pool without decode", {**PD, "disaggregation": {"prefill": {}}}, "decode"),
    ("adapters on pools", {**PD, "adapters": [{"name": "a", "source": "hf://org/adapter"}]}, "LoRA adapters"),
    ("offload on pools", {**PD, "offload": {"enabled": True, "cpuGiB": 4}}, "KV offload tiers"),
    ("speculation on a pool", {**PD, "disaggregation": {"prefill": {}, "decode": {
        "engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 2}}}}}, "speculative decoding"),
    ("speculation on the service", {**PD, "engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 2}}},
     "speculative decoding"),
    ("pools of several nodes", {**PD, "gpu": {"type": "l4", "nodes": 2}}, "one node"),
    ("another connector", {**PD, "disaggregation": {"prefill": {}, "decode": {}, "kvConnector": "MooncakeConnector"}},
     "kvConnector"),
    ("a privileged side-channel port", {**PD, "disaggregation": {"prefill": {}, "decode": {}, "sideChannelPort": 80}},
     "sideChannelPort"),
    ("a pool's batch below its sequences", {**PD, "disaggregation": {"prefill": {}, "decode": {
        "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}}}, "maxNumBatchedTokens must be >="),
]


@pytest.mark.parametrize("case, spec, phrase", BAD, ids=[b[0] for b in BAD])
def test_the_api_server_and_the_operator_refuse_the_same_specs(case, spec, phrase):
    errors = _admitted_errors(spec)
    assert errors and any(phrase in e for e in errors), (case, errors)
    with pytest.raises(SpecError, match=re.escape(phrase)):
        parse_spec(spec, "rag")


def test_good_specs_are_admitted_and_the_layout_keys_stay_the_services():
    for spec in (PD, {**PD, "disaggregation": {"prefill": {"replicas": 2}, "decode": {
            "autoscaling": {"mode": "hpa", "maxReplicas": 3}}}}, _example()["spec"]):
        assert _admitted_errors(spec) == [], spec
    # blockSize and kvCacheDtype are the service's: a pool's is pruned by the API server and
    # dropped by the operator alike, so both pools lay their KV blocks out the same way
    pool_layout = {**PD, "disaggregation": {"prefill": {"engine": {"blockSize": 32, "maxNumSeqs": 8}}, "decode": {}}}
    stored, errors = crd_schema.admit(SCHEMA, _cr(pool_layout))
    assert errors == [] and stored["spec"]["disaggregation"]["prefill"]["engine"] == {"maxNumSeqs": 8}
    parsed = parse_spec(pool_layout, "rag").disaggregation
    assert parsed.prefill.engine.pinned == {"max_num_seqs": 8} and parsed.decode.engine.pinned == {}
    # a pool's engine settings ride over the service's, and extraArgs add up
    layered = {**PD, "engine": {"maxNumSeqs": 4, "extraArgs": ["--seed", "1"]},
               "disaggregation": {"prefill": {"engine": {"maxNumSeqs": 2, "extraArgs": ["--seed", "2"]}},
                                  "decode": {}}}
    parsed = parse_spec(layered, "rag").disaggregation
    assert parsed.prefill.engine.pinned == {"max_num_seqs": 2} and parsed.decode.engine.pinned == {"max_num_seqs": 4}
    assert parsed.prefill.engine.extra_args == ("--seed", "1", "--seed", "2")
    prefill_args = _container(_build(_cr(layered), podmonitor=False)[("Deployment", "rag-prefill")])["args"]
    assert make_serve_parser().parse_args(prefill_args).seed == 2      # the pool's, last
