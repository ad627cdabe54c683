"""Checking RBAC rules rendered by the chart against the API calls a client really made.

A call (``api_calls.ApiCall``) is granted when a rule of a ClusterRole bound to the
operator's ServiceAccount by a ClusterRoleBinding, or of a Role bound by a RoleBinding in
the call's namespace, names its verb, API group, resource (``plural/subresource``) and,
where the rule lists ``resourceNames``, its object.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from support.api_calls import ApiCall

OPERATOR_AGENTS = ("kopf/", "kvpilot-operator")  # kopf's client and the operator's own


@dataclass(frozen=True)
class Grant:
    verb: str
    group: str
    resource: str                        # plural or plural/subresource
    namespace: str | None                # None: every namespace and cluster-scoped objects
    names: frozenset[str] | None = None  # resourceNames, None = any

    @property
    def key(self) -> tuple[str, str, str]:
        return self.verb, self.group, self.resource


def operator_calls(calls: Iterable[ApiCall]) -> list[ApiCall]:
    return [c for c in calls if c.user_agent.startswith(OPERATOR_AGENTS)]


def call_key(call: ApiCall) -> tuple[str, str, str]:
    resource = f"{call.resource}/{call.subresource}" if call.subresource else call.resource
    return call.verb, call.group, resource


def grants(docs: list[dict], service_account: str, namespace: str) -> list[Grant]:
    """Every permission ``namespace/service_account`` gets from the rendered ``docs``."""
    def bound(binding: dict) -> bool:
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == service_account
                   and s.get("namespace") == namespace for s in binding.get("subjects") or ())

    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("ClusterRole", "Role")}
    out = []
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding") or not bound(binding):
            continue
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role.get("rules") or ():
            names = frozenset(rule["resourceNames"]) if rule.get("resourceNames") else None
            for verb in rule["verbs"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        out.append(Grant(verb, group, resource, scope, names))
    return out


def allows(grant: Grant, call: ApiCall) -> bool:
    return grant.key == call_key(call) and \
        (grant.namespace is None or grant.namespace == call.namespace) and \
        (grant.names is None or call.name in grant.names)


def assert_chart_grants(calls: Iterable[ApiCall], values: Iterable = ()) -> None:
    """Every call the operator made is granted by the chart rendered with ``values`` files
    over cluster-wide RBAC (ci/cluster-rbac-values.yaml: the operator tests run it with
    ``--all-namespaces``)."""
    from support.chart import CHART, render

    docs = render([CHART / "ci" / "cluster-rbac-values.yaml", *values], release="kvpilot", namespace="kvpilot")
    missing = ungranted(operator_calls(calls), grants(docs, "kvpilot", "kvpilot"))
    assert not missing, f"charts/kvpilot's RBAC does not grant these operator calls: {missing}"


def ungranted(calls: Iterable[ApiCall], granted: list[Grant]) -> list[ApiCall]:
    """The calls no grant allows (each distinct call once)."""
    return sorted({c for c in calls if not any(allows(g, c) for g in granted)}, key=repr)
