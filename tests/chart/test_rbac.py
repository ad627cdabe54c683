"""Least privilege, proven: the chart's RBAC grants every call the operator makes and
nothing else but a short allow-list.

The real operator process runs with the arguments and environment the chart renders for
it, against the API emulator, through a lifecycle that makes every kind of call it has:
each child kind created, patched back after drift and (where the spec can drop it)
deleted (a disaggregated service's two pools included, issue 44), status patches, the removal of the finalizer older operators left on
InferenceServices, Events, kopf's watches and its peering keep-alives.
The emulator records every (verb, group, resource, subresource) the operator called; the
rules rendered by ``helm template`` must allow each call (in its namespace), and grant no
(verb, group, resource) that was not called, except ``ALLOWED_UNUSED``. A new watch or
write added to the operator shows up here without editing this test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kvpilot.operator import constants as c

from support.chart import CHART, of_kind, operator_container, operator_env, render
from support.engine_workload import LWS_CRD_PATH
from support.harness import (
    EmulatorThread,
    Kubectl,
    OperatorProcess,
    free_port,
    schemaless_crd,
    wait_for,
    write_kubeconfig,
)
from support.rbac import call_key, grants, operator_calls, ungranted

pytestmark = pytest.mark.slow
RELEASE, RELEASE_NS = "kvpilot", "kvpilot"

# What a real API server needs that the emulator cannot show.
ALLOWED_UNUSED = {
    # OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on a child's
    # ownerReference needs update on the owner's finalizers subresource.
    ("update", c.GROUP, f"{c.PLURAL}/finalizers"),
    # Escalation prevention: the operator may create the router's Role (pods get, list,
    # watch) only if it holds those permissions itself.
    ("get", "", "pods"),
}

FENCE = {"ServiceAccount", "NetworkPolicy"}  # every service's own account and NetworkPolicy
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
OFFLOAD = {**SMALL, "replicas": 1, "offload": {"enabled": True, "cpuGiB": 4, "disk": {"sizeGiB": 20}}}
# latency SLOs: a PrometheusRule child (dropped again when the spec loses them)
AUTOSCALED = {**SMALL, "slo": {**SMALL["slo"], "ttftP95Ms": 800, "itlP95Ms": 60},
              "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 4}}
# vLLM's router in front: its Deployment, Service, ServiceAccount, Role, RoleBinding, PDB
ROUTED = {**SMALL, "replicas": 2, "routing": {"router": "vllm-router"}}
ROUTER_KINDS = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                "PodDisruptionBudget", "PodMonitor"}
# prefill and decode pools behind the router in P/D mode (issue 44): two Deployments, KEDA on one,
# an HPA on the other, a PodDisruptionBudget each, and the router's children
SPLIT = {**SMALL, "routing": {"router": "vllm-router"}, "disaggregation": {
    "prefill": {"autoscaling": {"mode": "keda", "minReplicas": 2, "maxReplicas": 4}},
    "decode": {"autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 3}}}}
SPLIT_OBJECTS = {("Deployment", "split-prefill"), ("Deployment", "split-decode"), ("ScaledObject", "split-prefill"),
                 ("HorizontalPodAutoscaler", "split-decode"), ("PodDisruptionBudget", "split-prefill"),
                 ("PodDisruptionBudget", "split-decode"), ("ServiceAccount", "split-engine"),
                 ("NetworkPolicy", "split"), ("Service", "split"), ("PodMonitor", "split"),
                 *((kind, "split-router") for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                                                        "PodDisruptionBudget", "PodMonitor"))}
# replicas spanning nodes: a LeaderWorkerSet and its headless Service (crds/examples/llama-405b-fp8-two-nodes)
GROUPED = {"model": {"uri": "hf://RedHatAI/Meta-Llama-3.1-405B-Instruct-FP8", "architecture": "llama-3.1-405b-fp8"},
           "gpu": {"type": "h100-80gb", "count": 8},
           "slo": {"maxContext": 131072, "p95PromptTokens": 8192, "p95OutputTokens": 1024, "concurrency": 64}}


def _inference_pool_crd() -> dict:
    """The Gateway API inference extension's InferencePool (tests/operator/inferencepool_crd.yaml)."""
    path = Path(__file__).resolve().parents[1] / "operator" / "inferencepool_crd.yaml"
    return yaml.safe_load(path.read_text())


def _chart_crds() -> list[dict]:
    return [doc for path in sorted((CHART / "crds").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


class Scenario:
    """The emulator with the chart's CRDs, kubectl, and the operator as the chart runs it."""

    def __init__(self, emu: EmulatorThread, docs: list[dict], tmp) -> None:
        self.emu, self.docs = emu, docs
        kubeconfig = write_kubeconfig(emu.kubeconfig(), tmp)
        self.kubectl = Kubectl(kubeconfig, tmp)
        for ns in ("kvpilot", "team-a", "team-b"):
            self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        for doc in of_kind(docs, "ClusterKopfPeering") + of_kind(docs, "KopfPeering"):
            self.apply(doc)  # the chart's peering objects
        env = {**operator_env(docs), "KVPILOT_RESYNC_SECONDS": "1", "KVPILOT_LOG_LEVEL": "DEBUG",
               "KVPILOT_METRICS_PORT": str(free_port())}
        env.pop("KVPILOT_LIVENESS_ENDPOINT")  # the harness picks a free port
        self.operator = OperatorProcess(kubeconfig, tmp / "operator.log", env=env,
                                        args=tuple(operator_container(docs)["args"]))

    def apply(self, obj: dict) -> None:
        self.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(obj))

    def service(self, name: str, spec: dict, ns: str = "team-a", finalizers: list[str] | None = None) -> None:
        meta = {"name": name, "namespace": ns, **({"finalizers": finalizers} if finalizers else {})}
        self.apply({"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": meta, "spec": spec})

    def finalizers(self, name: str, ns: str = "team-a") -> list[str] | None:
        obj = self.emu.run(lambda e: e.objects.get((c.GROUP, c.PLURAL, ns, name)))
        return None if obj is None else obj["metadata"].get("finalizers") or []

    def children(self, name: str, ns: str = "team-a") -> dict[str, dict]:
        def find(e):
            return {o["kind"]: o for (g, p, n, nm), o in e.objects.items()
                    if n == ns and p != c.PLURAL and p != "events" and
                    (o["metadata"].get("labels") or {}).get(c.LABEL_INSTANCE) == name}
        return copy.deepcopy(self.emu.run(find))

    def wait_children(self, name: str, kinds: set[str], ns: str = "team-a") -> dict[str, dict]:
        return wait_for(lambda: (ch := self.children(name, ns)) and set(ch) == kinds and ch,
                        20, 0.1, f"{name}'s children to be exactly {sorted(kinds)}")

    def router_children(self, name: str, ns: str = "team-a") -> dict[str, dict]:
        """The router's children (named ``<name>-router``) by kind."""
        router = f"{name}-router"
        return copy.deepcopy(self.emu.run(lambda e: {
            o["kind"]: o for (g, p, n, nm), o in e.objects.items() if n == ns and nm == router}))

    def wait_router(self, name: str, kinds: set[str], ns: str = "team-a") -> dict[str, dict]:
        return wait_for(lambda: (ch := self.router_children(name, ns)) and set(ch) == kinds and ch,
                        20, 0.1, f"{name}'s router children to be exactly {sorted(kinds)}")

    def tamper_router(self, name: str, kinds: set[str], ns: str = "team-a") -> None:
        """As ``tamper``, for the router's children."""
        strip = json.dumps({"metadata": {"labels": {c.LABEL_MANAGED_BY: None}}})
        for kind in kinds:
            self.kubectl("-n", ns, "patch", kind.lower(), f"{name}-router", "--type", "merge", "-p", strip)

    def router_untampered(self, name: str, kinds: set[str], ns: str = "team-a") -> bool:
        ch = self.router_children(name, ns)
        return set(ch) == kinds and all(_applied_by_kvpilot(o) for o in ch.values())

    def objects(self, name: str, ns: str = "team-a") -> dict[tuple[str, str], dict]:
        """Every child of ``name`` by (kind, name): a service of several objects of one kind."""
        def find(e):
            return {(o["kind"], nm): o for (g, p, n, nm), o in e.objects.items()
                    if n == ns and p != c.PLURAL and p != "events" and
                    (o["metadata"].get("labels") or {}).get(c.LABEL_INSTANCE) == name}
        return copy.deepcopy(self.emu.run(find))

    def wait_objects(self, name: str, keys: set[tuple[str, str]], ns: str = "team-a") -> dict:
        return wait_for(lambda: (ch := self.objects(name, ns)) and set(ch) == keys and ch,
                        20, 0.1, f"{name}'s children to be exactly {sorted(keys)}")

    def tamper_objects(self, name: str, ns: str = "team-a") -> None:
        """As ``tamper``, for every child of every kind."""
        strip = json.dumps({"metadata": {"labels": {c.LABEL_MANAGED_BY: None}}})
        for kind, child in self.objects(name, ns):
            self.kubectl("-n", ns, "patch", kind.lower(), child, "--type", "merge", "-p", strip)

    def tamper(self, name: str, ns: str = "team-a") -> None:
        """Strip the managed-by label from every child, through the API: each leaves the
        operator's label-selected watch, so the operator misses it, reads it by name and
        applies it back."""
        strip = json.dumps({"metadata": {"labels": {c.LABEL_MANAGED_BY: None}}})
        for kind, child in self.children(name, ns).items():
            self.kubectl("-n", ns, "patch", kind.lower(), child["metadata"]["name"], "--type", "merge",
                         "-p", strip)

    def untampered(self, name: str, ns: str = "team-a") -> bool:
        return all(_applied_by_kvpilot(o) for o in self.children(name, ns).values())

    def delete(self, name: str, ns: str = "team-a") -> None:
        self.kubectl("delete", "inferenceservice", name, "-n", ns, "--wait=false")
        wait_for(lambda: not self.emu.run(lambda e: (c.GROUP, c.PLURAL, ns, name) in e.objects),
                 20, 0.1, f"{name} deleted (finalizer released)")


def _applied_by_kvpilot(o: dict) -> bool:
    """The object carries kvpilot's label and an Apply entry of kvpilot's field manager."""
    return ((o["metadata"].get("labels") or {}).get(c.LABEL_MANAGED_BY) == c.MANAGER and
            any(e["manager"] == c.FIELD_MANAGER and e["operation"] == "Apply"
                for e in o["metadata"].get("managedFields") or ()))


def _all_applied(objects: dict, keys: set) -> bool:
    return set(objects) == keys and all(_applied_by_kvpilot(o) for o in objects.values())


def _prove(calls, docs) -> tuple[set, set]:
    """(calls no rule grants, grants no call used) for the operator's ServiceAccount."""
    granted = grants(docs, RELEASE, RELEASE_NS)
    assert not [g for g in granted if "*" in (g.verb, g.group, g.resource)], "no wildcards"
    used = {call_key(call) for call in calls}
    return set(ungranted(calls, granted)), {g.key for g in granted} - used - ALLOWED_UNUSED


def test_cluster_rbac_grants_exactly_what_the_operator_calls(tmp_path):
    docs = render([CHART / "ci" / "cluster-rbac-values.yaml"], release=RELEASE, namespace=RELEASE_NS)
    crds = _chart_crds() + [schemaless_crd("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"),
                            schemaless_crd("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors"),
                            schemaless_crd("monitoring.coreos.com", "v1", "PrometheusRule",
                                           "prometheusrules"),
                            _inference_pool_crd(), yaml.safe_load(LWS_CRD_PATH.read_text())]
    with EmulatorThread(crds) as emu:
        s = Scenario(emu, docs, tmp_path)
        with s.operator:
            s.service("cached", OFFLOAD)
            s.service("scaled", AUTOSCALED)
            s.service("routed", ROUTED)
            s.service("grouped", GROUPED)
            s.service("split", SPLIT)
            # as an operator before issue 43 left it: this one patches the finalizer away
            s.service("legacy", SMALL, finalizers=[c.FINALIZER])
            wait_for(lambda: s.finalizers("legacy") == [], 20, 0.1, "the legacy finalizer removed")
            s.delete("legacy")
            s.wait_children("grouped", {*FENCE, "LeaderWorkerSet", "Service", "PodMonitor", "InferencePool"})
            s.wait_children("cached", {*FENCE, "Deployment", "Service", "PersistentVolumeClaim", "PodMonitor",
                                       "InferencePool"})
            scaled = s.wait_children("scaled", {*FENCE, "Deployment", "Service", "HorizontalPodAutoscaler",
                                                "PodMonitor", "PrometheusRule", "PodDisruptionBudget",
                                                "InferencePool"})
            # acceptance: the engine image the chart rendered is what the operator runs
            image = operator_env(docs)["KVPILOT_ENGINE_IMAGE"]
            pod = scaled["Deployment"]["spec"]["template"]["spec"]
            assert [x["image"] for x in pod["containers"] + pod["initContainers"]] == [image, image]
            router = s.wait_router("routed", ROUTER_KINDS)
            # the router's identity may do exactly what its service discovery does
            assert router["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                                "verbs": ["get", "list", "watch"]}]
            assert router["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == \
                operator_env(docs)["KVPILOT_ROUTER_IMAGE"]
            split = s.wait_objects("split", SPLIT_OBJECTS)
            router_args = split[("Deployment", "split-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
            assert "--vllm-pd-disaggregation" in router_args
            for name in ("cached", "scaled", "routed", "grouped"):  # every child kind patched back
                s.tamper(name)
            s.tamper_router("routed", ROUTER_KINDS)
            s.tamper_objects("split")
            wait_for(lambda: s.untampered("cached") and s.untampered("scaled") and s.untampered("routed")
                     and s.untampered("grouped") and s.router_untampered("routed", ROUTER_KINDS)
                     and _all_applied(s.objects("split"), SPLIT_OBJECTS),
                     20, 0.1, "drift repaired")
            # one pool doing both again: the pools, their autoscalers and budgets and the router go
            s.service("split", {**SMALL, "replicas": 1, "routing": {"inferencePool": {"enabled": False}}})
            s.wait_objects("split", {("Deployment", "split"), ("Service", "split"), ("ServiceAccount", "split-engine"),
                                     ("NetworkPolicy", "split"), ("PodMonitor", "split"),
                                     ("PersistentVolumeClaim", "split-model-cache")})
            s.delete("split")
            # one node holds 16 sequences: a Deployment again, the group and its headless Service go
            s.service("grouped", {**GROUPED, "slo": {**GROUPED["slo"], "concurrency": 16}})
            s.wait_children("grouped", {*FENCE, "Deployment", "Service", "PodMonitor", "InferencePool",
                                        "PersistentVolumeClaim"})   # one pod: the model cache is a claim
            wait_for(lambda: s.emu.run(lambda e: ("", "services", "team-a", "grouped-group") not in e.objects),
                     20, 0.1, "the group's headless Service deleted")
            s.delete("grouped")
            s.service("routed", {**SMALL, "replicas": 2})     # router off: its children go
            wait_for(lambda: not s.router_children("routed"), 20, 0.1, "the router's children deleted")
            s.delete("routed")
            s.service("scaled", {**AUTOSCALED, "autoscaling": {"mode": "keda", "minReplicas": 2,
                                                               "maxReplicas": 4}})
            s.wait_children("scaled", {*FENCE, "Deployment", "Service", "ScaledObject", "PodMonitor",
                                       "PrometheusRule", "PodDisruptionBudget", "InferencePool"})
            s.tamper("scaled")
            wait_for(lambda: s.untampered("scaled"), 20, 0.1, "ScaledObject repaired")
            # one replica: the hf:// model cache becomes a claim child (the disk tier's goes);
            # routing off: the InferencePool goes
            s.service("scaled", {**SMALL, "replicas": 1, "routing": {"inferencePool": {"enabled": False}}})
            s.wait_children("scaled", {*FENCE, "Deployment", "Service", "PodMonitor", "PersistentVolumeClaim"})
            s.service("cached", {**SMALL, "replicas": 1})
            wait_for(lambda: s.emu.run(lambda e: ("", "persistentvolumeclaims", "team-a", "cached-kv-disk")
                                       not in e.objects), 20, 0.1, "the disk tier's claim deleted")
            s.wait_children("cached", {*FENCE, "Deployment", "Service", "PodMonitor", "PersistentVolumeClaim",
                                       "InferencePool"})
            s.delete("cached")
            s.delete("scaled")
        calls = operator_calls(emu.emulator.calls)
        assert emu.emulator.failures == []
    assert "Traceback" not in s.operator.log(), s.operator.log()[-3000:]
    missing, extra = _prove(calls, docs)
    assert missing == set(), f"the chart's RBAC does not grant: {sorted(map(repr, missing))}"
    assert extra == set(), f"the chart's RBAC grants what the operator never used: {sorted(extra)}"
    used = {call_key(call) for call in calls}
    print(f"\nRBAC proof (cluster): {len(calls)} operator calls, {len(used)} distinct "
          f"(verb, group, resource): {sorted(used)}")
    # the lifecycle really covered every child kind's list + watch (the operator's cache),
    # create and patch (a server-side apply that creates is authorized as both), get (a
    # child the cache did not show) and, where droppable, delete
    for kind in ("deployments", "services", "persistentvolumeclaims", "horizontalpodautoscalers",
                 "scaledobjects", "podmonitors", "prometheusrules", "poddisruptionbudgets",
                 "inferencepools", "serviceaccounts", "roles", "rolebindings", "networkpolicies",
                 "leaderworkersets"):
        assert {v for v, g, r in used if r == kind} >= {"list", "watch", "get", "create", "patch"}, kind
    assert {v for v, g, r in used if r == "pods"} == {"list", "watch"}
    assert {r for v, g, r in used if v == "delete"} == {
        "persistentvolumeclaims", "horizontalpodautoscalers", "scaledobjects", "poddisruptionbudgets",
        "inferencepools", "prometheusrules", "deployments", "services", "serviceaccounts", "roles",
        "rolebindings", "podmonitors", "leaderworkersets"}
    assert ("patch", "kopf.dev", "clusterkopfpeerings") in used
    # the check can fail: without one rule, the calls that need it are reported
    (role,) = [r for r in of_kind(docs, "ClusterRole") if r["metadata"]["name"] == RELEASE]
    role["rules"] = [r for r in role["rules"] if r["resources"] != [f"{c.PLURAL}/status"]]
    missing, _ = _prove(calls, docs)
    assert {(m.verb, m.resource, m.subresource) for m in missing} == {("patch", c.PLURAL, "status")}


def test_namespaced_rbac_covers_the_operator_in_its_namespaces(tmp_path):
    docs = render([CHART / "ci" / "namespaced-rbac-values.yaml"], release=RELEASE, namespace=RELEASE_NS)
    with EmulatorThread(_chart_crds()) as emu:
        s = Scenario(emu, docs, tmp_path)
        with s.operator:
            s.service("ignored", SMALL, ns="default")  # not watched: never touched
            s.service("scaled", AUTOSCALED)
            s.service("other", SMALL, ns="team-b")
            s.wait_children("scaled", {*FENCE, "Deployment", "Service", "HorizontalPodAutoscaler",
                                       "PodDisruptionBudget"})
            s.wait_children("other", {*FENCE, "Deployment", "Service", "PersistentVolumeClaim"}, ns="team-b")
            assert s.children("ignored", ns="default") == {}
            s.delete("scaled")
        calls = operator_calls(emu.emulator.calls)
    missing, _ = _prove(calls, docs)
    assert missing == set(), f"the chart's RBAC does not grant: {sorted(map(repr, missing))}"
    assert {call.namespace for call in calls} == {"team-a", "team-b", None}
    cluster_scoped = {call_key(call) for call in calls if call.namespace is None}
    assert {r for _, _, r in cluster_scoped} == {"customresourcedefinitions", "namespaces"}
    print(f"\nRBAC proof (namespaces): {len(calls)} operator calls, cluster-scoped: {sorted(cluster_scoped)}")
