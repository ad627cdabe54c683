"""The platform's policy on specs (``security.check_spec``) and the engine pods' fence
(NetworkPolicy, service account, no API token), as pure builders.

Oracles: kubernetes-validate (strict) for every object built, the real serve parser's
port, and the settings the chart renders (``tests/chart``) for the defaults.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator.resources import NETWORK_POLICY, SERVICE_ACCOUNT, desired_children
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.network_policy import build_network_policy
from kvpilot.operator.security import (
    NetworkFence,
    PolicyViolation,
    SpecPolicy,
    check_spec,
    engine_service_account,
    glob_regex,
    labels,
)
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_service

from support import crd_schema
from support.deputy_specs import DEPUTY_SPECS, FOREIGN_ACCOUNT, FOREIGN_IMAGE, GOOD
from support.engine_workload import assert_valid_workload, leader_template, templates, workload

K8S_VERSION = "1.33"
ENGINE = OperatorSettings().engine_image


def _check(spec: dict, policy: SpecPolicy = SpecPolicy(), name: str = "chat") -> None:
    check_spec(parse_spec(spec, name), name, policy, ENGINE)


def test_a_good_spec_passes_the_default_policy():
    _check(GOOD)
    _check({**GOOD, "image": ENGINE, "serviceAccountName": engine_service_account("chat")})


@pytest.mark.parametrize("case", DEPUTY_SPECS)
def test_the_confused_deputy_specs_are_refused_with_a_reason(case):
    spec, reason = DEPUTY_SPECS[case]
    with pytest.raises(PolicyViolation) as info:
        _check(spec)
    assert info.value.reason == reason
    assert str(info.value).startswith("spec.")  # names the field


def test_the_platform_widens_the_policy_by_glob_and_name():
    policy = SpecPolicy(allowed_images=("docker.io/attacker/*",), allowed_service_accounts=("cluster-admin-sa",))
    _check(FOREIGN_IMAGE, policy)
    _check(FOREIGN_ACCOUNT, policy)
    with pytest.raises(PolicyViolation, match="ImageNotAllowed|is not allowed"):
        _check({**GOOD, "image": "docker.io/attacker-2/x:1"}, policy)
    # declaring a Secret is what makes it readable, and only Secrets the platform allows
    with pytest.raises(PolicyViolation) as info:
        _check({**GOOD, "envSecrets": ["tracing"]}, SpecPolicy(allowed_secrets=("hf-*", "chat-*")))
    assert info.value.reason == "SecretNotAllowed" and "'tracing'" in str(info.value)
    with pytest.raises(PolicyViolation, match="spec.apiKeySecretRef: Secret 'chat-api-key'"):
        _check(GOOD, SpecPolicy(allowed_secrets=("hf-*", "tracing")))
    _check(GOOD, SpecPolicy(allowed_secrets=("hf-*", "chat-*", "tracing")))
    with pytest.raises(PolicyViolation, match="spec.model.credentialsSecretRef: Secret 'hf-token'"):
        _check({**GOOD, "envSecrets": [], "env": []}, SpecPolicy(allowed_secrets=()))


@pytest.mark.parametrize("pattern, value, hit", [
    ("ghcr.io/kvpilot/*", "ghcr.io/kvpilot/kvpilot:0.2.0", True),
    ("ghcr.io/kvpilot/*", "ghcr.io/kvpilot-evil/x:1", False),
    ("ghcr.io/kvpilot/kvpilot:0.?.0", "ghcr.io/kvpilot/kvpilot:0.3.0", True),
    ("a.b/c", "aXb/c", False),          # '.' is literal
    ("a/c", "a/c:tag", False),          # anchored
])
def test_globs_mean_only_star_and_question_mark(pattern, value, hit):
    import re

    assert bool(re.match(glob_regex(pattern), value)) == hit


def _children(spec: dict, settings: OperatorSettings = OperatorSettings(), name: str = "chat") -> dict:
    parsed = parse_spec(spec, name)
    outcome = plan_service(parsed)
    assert outcome.feasible, outcome.message
    children = desired_children(Owner(name, "serving", "uid-1"), parsed, outcome.sizing, settings,
                                podmonitor_api=False)
    return {ch.kind.kind: ch for ch in children}


@pytest.mark.parametrize("path", crd_schema.ONE_POOL_EXAMPLES, ids=lambda p: p.stem)
def test_every_engine_pod_is_fenced_and_has_no_token(path):
    obj = yaml.safe_load(path.read_text())
    children = _children(obj["spec"], name=obj["metadata"]["name"])
    account = children["ServiceAccount"]
    assert account.kind is SERVICE_ACCOUNT and account.body["automountServiceAccountToken"] is False
    policy = children["NetworkPolicy"]
    assert policy.kind is NETWORK_POLICY
    for child in (account, policy):
        assert kubernetes_validate.validate(child.body, K8S_VERSION, strict=True) == K8S_VERSION
    assert_valid_workload(workload(children))
    # every pod the workload makes (a group's leader and workers too): no token, and fenced
    for template in templates(workload(children)):
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == engine_service_account(obj["metadata"]["name"]) == account.name
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        template_labels = template["metadata"]["labels"]
        selector = policy.body["spec"]["podSelector"]
        assert selector["matchLabels"].items() <= template_labels.items()
        for expr in selector.get("matchExpressions", ()):
            assert (expr["operator"], template_labels[expr["key"]] in expr["values"]) == ("In", True)
    pod = leader_template(children)["spec"]
    assert policy.body["spec"]["policyTypes"] == ["Ingress", "Egress"]
    port = pod["containers"][0]["ports"][0]["containerPort"]
    assert policy.body["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": port}]


def _rules(policy: dict) -> tuple[list, list]:
    return policy["spec"]["ingress"], policy["spec"]["egress"]


def test_ingress_comes_only_from_clients_monitoring_the_operator_and_peers():
    fence = NetworkFence(operator_namespace="kvpilot-system")
    parsed = parse_spec(GOOD, "chat")
    ingress, egress = _rules(build_network_policy(Owner("chat", "serving"), parsed, fence))
    clients, peers = ingress
    assert clients["from"] == [
        {"podSelector": {"matchLabels": {"serving.kvpilot.dev/client": "true"}}},  # this namespace only
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpilot-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpilot",
                                         "app.kubernetes.io/component": "operator"}}}]
    assert peers == {"from": [{"podSelector": {"matchLabels": Owner("chat", "serving").selector_labels}}]}
    dns, to_peers, model = egress
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert dns["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert to_peers == {"to": [{"podSelector": {"matchLabels": Owner("chat", "serving").selector_labels}}]}
    assert model == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}],
                     "ports": [{"protocol": "TCP", "port": 443}]}  # the Hub


def test_egress_to_the_outside_only_where_the_spec_needs_it():
    fence = NetworkFence(monitoring_namespace=None, client_namespace_labels={"gateway": "yes"},
                         model_egress_cidrs=("10.20.0.0/16",))
    pvc = {**GOOD, "model": {"uri": "pvc://weights/qwen3"}}
    ingress, egress = _rules(build_network_policy(Owner("chat", "serving"), parse_spec(pvc, "chat"), fence))
    assert len(egress) == 2  # DNS and the peers: weights on a claim need nothing outside
    assert ingress[0]["from"] == [{"podSelector": {"matchLabels": {"serving.kvpilot.dev/client": "true"}},
                                   "namespaceSelector": {"matchLabels": {"gateway": "yes"}}}]
    remote = {**pvc, "offload": {"enabled": True, "backend": "lmcache",
                                 "lmcache": {"remoteUrl": "lm://lmcache.cache.svc:65432"}}}
    _, egress = _rules(build_network_policy(Owner("chat", "serving"), parse_spec(remote, "chat"), fence))
    assert egress[2] == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 65432}]}


def test_the_fence_can_be_switched_off_and_an_allowed_account_is_used():
    settings = OperatorSettings.from_env({"KVPILOT_NETWORK_POLICY": "off",
                                          "KVPILOT_ALLOWED_SERVICE_ACCOUNTS": "shared-engine"})
    children = _children({**GOOD, "serviceAccountName": "shared-engine"}, settings)
    assert "NetworkPolicy" not in children
    pod = children["Deployment"].body["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "shared-engine" and pod["automountServiceAccountToken"] is False


def test_settings_read_the_policy_and_the_fence_from_the_environment():
    s = OperatorSettings.from_env({
        "KVPILOT_ALLOWED_IMAGES": "registry.example/ml/*, ghcr.io/kvpilot/*",
        "KVPILOT_ALLOWED_SECRETS": "",
        "KVPILOT_NETWORK_CLIENT_LABELS": "app=gateway,tier=edge",
        "KVPILOT_NETWORK_CLIENT_NAMESPACE_LABELS": "kubernetes.io/metadata.name=gateways",
        "KVPILOT_NETWORK_MONITORING_NAMESPACE": "",
        "KVPILOT_NETWORK_MODEL_EGRESS_PORTS": "443,8443",
        "KVPILOT_OPERATOR_NAMESPACE": "kvpilot"})
    assert s.policy == SpecPolicy(("registry.example/ml/*", "ghcr.io/kvpilot/*"), (), ())
    assert s.fence.client_pod_labels == {"app": "gateway", "tier": "edge"}
    assert s.fence.client_namespace_labels == {"kubernetes.io/metadata.name": "gateways"}
    assert (s.fence.monitoring_namespace, s.fence.operator_namespace) == (None, "kvpilot")
    assert s.fence.model_egress_ports == (443, 8443)
    assert OperatorSettings.from_env({}).policy == SpecPolicy()  # any declared Secret by default
    for env, message in (({"KVPILOT_NETWORK_CLIENT_LABELS": "gateway"}, "label=value"),
                         ({"KVPILOT_NETWORK_CLIENT_LABELS": ""}, "at least one label"),
                         ({"KVPILOT_NETWORK_POLICY": "maybe"}, "on or off"),
                         ({"KVPILOT_NETWORK_MODEL_EGRESS_PORTS": "https"}, "ports")):
        with pytest.raises(ValueError, match=message):
            OperatorSettings.from_env(env)
    assert labels(" a = b , c=d ") == {"a": "b", "c": "d"}


def test_the_crd_accepts_the_declared_secrets_field():
    schema = crd_schema.version_schema(crd_schema.load_crd())
    cr = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
          "metadata": {"name": "chat"}, "spec": copy.deepcopy(GOOD)}
    stored, errors = crd_schema.admit(schema, cr)
    assert errors == [] and stored["spec"]["envSecrets"] == ["tracing"]
    _, errors = crd_schema.admit(schema, {**cr, "spec": {**GOOD, "envSecrets": [""]}})
    assert errors
