"""The chart's ValidatingAdmissionPolicy: the operator's spec policy at the API server.

Oracles: the real ``helm`` renders the policy from the chart's values; ``cel-python`` (the
CEL the CRD tests already evaluate the CRD's rules with) runs its match condition,
variables and validations as the API server would on an InferenceService; and the
operator's own ``check_spec``, given the environment the same render hands the operator,
must reach the same decision on every spec.
"""

from __future__ import annotations

import copy

import celpy
import pytest

from kvpilot.operator.security import PolicyViolation, check_spec
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec

from support.chart import helm, of_kind, operator_env, render
from support.deputy_specs import (
    DEPUTY_SPECS,
    FOREIGN_ACCOUNT,
    FOREIGN_IMAGE,
    GOOD,
    UNDECLARED_SECRET,
)

NAME = "chat"
SPEC_POLICY = "kvpilot-inferenceservices"               # the spec policy of release kvpilot
UNWATCHED_POLICY = "kvpilot-unwatched-namespaces"       # the warning about unwatched namespaces


def _cel(expression: str, activation: dict):
    env = celpy.Environment()
    return env.program(env.compile(expression)).evaluate(activation)


def _cr(spec: dict) -> dict:
    return {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": "team-a"}, "spec": copy.deepcopy(spec)}


def admission(policy: dict, obj: dict, old: dict | None = None) -> list[str] | None:
    """The messages of the validations ``obj`` breaks (CREATE when ``old`` is None), or None
    when the policy's match conditions leave the request alone."""
    base = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old)}
    for cond in policy["spec"].get("matchConditions") or ():
        if not bool(_cel(cond["expression"], base)):
            return None
    variables: dict = {}
    for var in policy["spec"].get("variables") or ():
        variables[var["name"]] = _cel(var["expression"], {**base, "variables": celpy.json_to_cel(variables)})
    activation = {**base, "variables": celpy.json_to_cel(variables)}
    broken = []
    for rule in policy["spec"]["validations"]:
        result = _cel(rule["expression"], activation)
        if isinstance(result, celpy.CELEvalError):  # an error denies (failurePolicy: Fail)
            broken.append(f"error: {result}")
        elif not bool(result):
            broken.append(str(_cel(rule["messageExpression"], activation)) if "messageExpression" in rule
                          else rule["message"])
    return broken


def _policy(sets: list[str] = ()) -> tuple[dict, OperatorSettings]:
    docs = render(sets=sets)
    (policy,) = [p for p in of_kind(docs, "ValidatingAdmissionPolicy") if p["metadata"]["name"] == SPEC_POLICY]
    (binding,) = [b for b in of_kind(docs, "ValidatingAdmissionPolicyBinding")
                  if b["metadata"]["name"] == SPEC_POLICY]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": ["serving.kvpilot.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
         "resources": ["inferenceservices"]}]
    return policy, OperatorSettings.from_env(operator_env(docs))


def _operator_refuses(spec: dict, settings: OperatorSettings) -> str | None:
    try:
        check_spec(parse_spec(spec, NAME), NAME, settings.policy, settings.engine_image)
    except PolicyViolation as exc:
        return exc.reason
    return None


def test_the_good_spec_is_admitted():
    policy, settings = _policy()
    assert admission(policy, _cr(GOOD)) == []
    engine_image = settings.engine_image
    assert admission(policy, _cr({**GOOD, "image": engine_image, "serviceAccountName": f"{NAME}-engine"})) == []


@pytest.mark.parametrize("case", DEPUTY_SPECS)
def test_the_confused_deputy_specs_are_denied_with_the_operators_reason(case):
    spec, reason = DEPUTY_SPECS[case]
    policy, _ = _policy()
    broken = admission(policy, _cr(spec))
    assert len(broken) == 1 and f"({reason})" in broken[0], broken


SETS = {
    "defaults": [],
    "images-by-glob": ["security.allowedImages={docker.io/attacker/*}"],
    "one-exact-image": ["security.allowedImages={docker.io/attacker/miner:lates?}"],
    "shared-account": ["security.allowedServiceAccounts={cluster-admin-sa,other}"],
    "few-secrets": ["security.allowedSecrets={hf-*,chat-*}"],
    "no-secrets": ["security.allowedSecrets=null"],
}
SPECS = {
    "good": GOOD, **{case: spec for case, (spec, _) in DEPUTY_SPECS.items()},
    "other-image": {**GOOD, "image": "docker.io/attacker-2/x:1"},
    "dotted-image": {**GOOD, "image": "docker.io/attackerXminer"},
    "no-secrets-at-all": {**{k: v for k, v in GOOD.items() if k not in ("env", "envSecrets", "apiKeySecretRef")},
                          "model": {"uri": "hf://Qwen/Qwen3-0.6B"}},
    "declared-secret-read": {**UNDECLARED_SECRET, "envSecrets": ["prod-db"]},
    "engine-image-and-account": {**FOREIGN_ACCOUNT, "image": FOREIGN_IMAGE["image"],
                                 "serviceAccountName": f"{NAME}-engine"},
}


@pytest.mark.parametrize("values", SETS)
def test_the_policy_and_the_operator_decide_alike_from_the_same_values(values):
    policy, settings = _policy(SETS[values])
    decisions = {}
    for name, spec in SPECS.items():
        broken = admission(policy, _cr(spec))
        refused = _operator_refuses(spec, settings)
        assert bool(broken) == (refused is not None), (name, broken, refused)
        if refused is not None:
            assert any(f"({refused})" in message for message in broken), (name, broken, refused)
        decisions[name] = refused
    assert decisions["good"] is None or values in ("few-secrets", "no-secrets")
    print(f"\n{values}: {decisions}")


def test_only_spec_changes_are_checked():
    policy, _ = _policy()
    refused = _cr(FOREIGN_IMAGE)
    finalized = copy.deepcopy(refused)
    finalized["metadata"]["finalizers"] = ["serving.kvpilot.dev/finalizer"]
    assert admission(policy, finalized, old=refused) is None  # the operator's own metadata write
    assert admission(policy, refused, old=_cr(GOOD)) == [
        "spec.image docker.io/attacker/miner:latest is not allowed (ImageNotAllowed)"]


def test_the_policy_is_rendered_only_where_the_api_serves_it():
    for sets, kube, present in (([], "1.30.0", True), ([], "1.29.5", False),
                                (["security.admissionPolicy.enabled=false"], "1.33.0", False)):
        run = helm("template", "kvpilot", "--kube-version", kube, *[a for s in sets for a in ("--set", s)])
        assert run.returncode == 0, run.stderr
        assert (f"name: {SPEC_POLICY}\n" in run.stdout) == present, (sets, kube)
        # the warning about unwatched namespaces needs the same API
        assert (f"name: {UNWATCHED_POLICY}\n" in run.stdout) == (kube != "1.29.5"), (sets, kube)


def _selected(selector: dict, namespace: str) -> bool:
    """Whether a binding's namespaceSelector (matchExpressions on the namespace's name label,
    which the API server sets on every namespace) selects ``namespace``."""
    labels = {"kubernetes.io/metadata.name": namespace}
    for expr in selector.get("matchExpressions") or ():
        value = labels.get(expr["key"])
        if expr["operator"] == "NotIn" and value in expr["values"]:
            return False
        if expr["operator"] == "In" and value not in expr["values"]:
            return False
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _unwatched(sets: list[str]) -> tuple[dict, dict] | None:
    docs = render(sets=sets)
    policies = [p for p in of_kind(docs, "ValidatingAdmissionPolicy") if p["metadata"]["name"] == UNWATCHED_POLICY]
    bindings = [b for b in of_kind(docs, "ValidatingAdmissionPolicyBinding")
                if b["metadata"]["name"] == UNWATCHED_POLICY]
    assert len(policies) == len(bindings) <= 1
    return (policies[0], bindings[0]) if policies else None


def test_an_inference_service_outside_the_watched_namespaces_is_warned_about():
    """Issue 43: an InferenceService in a namespace the release does not watch got no status
    and no Event, and nothing said why. kubectl apply now prints the API server's warning
    (the object is still created: the binding only warns)."""
    policy, binding = _unwatched([])
    assert binding["spec"]["validationActions"] == ["Warn"]
    assert policy["spec"]["failurePolicy"] == "Ignore"
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    selector = binding["spec"]["matchResources"]["namespaceSelector"]
    assert _selected(selector, "default") and _selected(selector, "team-a") and not _selected(selector, "kvpilot")
    (rule,) = policy["spec"]["validations"]
    activation = {"request": celpy.json_to_cel({"namespace": "default"}), "object": celpy.json_to_cel(_cr(GOOD))}
    assert bool(_cel(rule["expression"], activation)) is False
    message = str(_cel(rule["messageExpression"], activation))
    assert message == ("namespace default is not watched by the kvpilot operator of release kvpilot/kvpilot (it "
                       "watches kvpilot): this InferenceService gets no status and no Events there; kubectl get kvis "
                       "-A shows it with empty columns")
    _, listed = _unwatched(["watchNamespaces={team-a,team-b}"])
    selector = listed["spec"]["matchResources"]["namespaceSelector"]
    assert [_selected(selector, ns) for ns in ("team-a", "team-b", "kvpilot")] == [False, False, True]
    assert _unwatched(["rbac.scope=cluster"]) is None          # every namespace is watched
    assert _unwatched(["unwatchedNamespaceWarning.enabled=false"]) is None
