"""The real operator process (``kvpilot operator``) against the API emulator on loopback.

One emulator and one operator serve the whole module (start-up costs ~1.5 s); each test
uses its own InferenceService. Objects are created and changed with the real kubectl,
observed in the emulator's store, and writes are counted at the emulator.
"""

from __future__ import annotations

import copy
import json
import re
import time

import crd_schema
import pytest
import yaml
from chart import CHART
from harness import EmulatorThread, Kubectl, OperatorProcess, wait_for, write_kubeconfig
from rbac import assert_chart_grants

from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator import constants as c

pytestmark = pytest.mark.slow
NS = "team-a"
CHILD_PLURALS = ("deployments", "services", "persistentvolumeclaims", "horizontalpodautoscalers",
                 "poddisruptionbudgets", "podmonitors", "scaledobjects")
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}
INFEASIBLE = {"model": {"uri": "hf://Qwen/Qwen3-32B"}, "gpu": {"type": "l4"},
              "slo": {"maxContext": 32768, "p95PromptTokens": 16000, "p95OutputTokens": 1000,
                      "concurrency": 64}}


class Cluster:
    """The emulator, kubectl and the operator of this module."""

    def __init__(self, emu: EmulatorThread, kubectl: Kubectl, operator: OperatorProcess) -> None:
        self.emu, self.kubectl, self.operator = emu, kubectl, operator

    def obj(self, plural: str, name: str, ns: str = NS) -> dict | None:
        def find(e):
            return next((o for (g, p, n, nm), o in e.objects.items() if p == plural and n == ns and nm == name),
                        None)
        return copy.deepcopy(self.emu.run(find))

    def cr(self, name: str) -> dict | None:
        return self.obj("inferenceservices", name)

    def children(self, name: str) -> dict[str, dict]:
        def find(e):
            return {o["kind"]: o for (g, p, n, nm), o in e.objects.items()
                    if p in CHILD_PLURALS and n == NS and
                    (o["metadata"].get("labels") or {}).get(c.LABEL_INSTANCE) == name}
        return copy.deepcopy(self.emu.run(find))

    def condition(self, name: str, ctype: str) -> dict | None:
        cr = self.cr(name) or {}
        return next((x for x in (cr.get("status") or {}).get("conditions") or () if x["type"] == ctype), None)

    def wait_condition(self, name: str, ctype: str, status: str, timeout: float = 20) -> dict:
        return wait_for(lambda: (cond := self.condition(name, ctype)) and cond["status"] == status and cond,
                        timeout, what=f"{name} {ctype}={status}")

    def apply(self, name: str, spec: dict, labels: dict | None = None) -> None:
        obj = {"apiVersion": c.API_VERSION, "kind": c.KIND,
               "metadata": {"name": name, "namespace": NS, **({"labels": labels} if labels else {})},
               "spec": spec}
        self.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(obj))

    def writes(self) -> int:
        return len(self.emu.emulator.writes)

    def writes_since(self, mark: int) -> list:
        return self.emu.emulator.writes[mark:]

    def events(self, name: str) -> list[dict]:
        def find(e):
            return [o for (g, p, n, nm), o in e.objects.items()
                    if p == "events" and g == "" and o["involvedObject"].get("name") == name]
        return copy.deepcopy(self.emu.run(find))

    def timer_runs(self) -> int:
        return len(re.findall(r"Timer 'build_registry.<locals>.observe' succeeded", self.operator.log()))

    def settle(self, runs: int = 2) -> None:
        """Wait until the periodic observer has run ``runs`` more times."""
        start = self.timer_runs()
        wait_for(lambda: self.timer_runs() >= start + runs, 20, 0.1, "observer timer runs")

    def quiesce(self, window: float = 2.5) -> None:
        """Wait until a ``window`` (over two resync periods) passes without any write."""
        def quiet() -> bool:
            mark = self.writes()
            time.sleep(window)
            return self.writes() == mark
        wait_for(quiet, 30, 0, "a quiet cluster")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operator")
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(NS), tmp)
        operator = OperatorProcess(kubeconfig, tmp / "operator.log")
        operator.start()
        try:
            yield Cluster(emu, Kubectl(kubeconfig, tmp, NS), operator)
        finally:
            operator.stop()
            assert emu.emulator.failures == []
            assert "Traceback" not in operator.log(), operator.log()[-4000:]
            # every call of every scenario here is one the Helm chart's RBAC grants
            assert_chart_grants(emu.emulator.calls, [CHART / "ci" / "ha-off-values.yaml"])


def _args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_create_builds_children_with_the_planned_args(cluster):
    cluster.apply("chat", SMALL)
    planned = cluster.wait_condition("chat", "Planned", "True")
    children = wait_for(lambda: (ch := cluster.children("chat")) and "Deployment" in ch and "Service" in ch
                        and ch, what="children")
    cr = cluster.cr("chat")
    status = cr["status"]
    assert planned["observedGeneration"] == status["observedGeneration"] == cr["metadata"]["generation"] == 1
    ns = make_serve_parser().parse_args(_args(children["Deployment"]))
    plan = status["plan"]
    assert (ns.max_num_seqs, ns.kv_cache_dtype, ns.max_model_len) == \
        (plan["maxNumSeqs"], plan["kvCacheDtype"], plan["maxModelLen"])
    assert _args(children["Deployment"])[-len(plan["serveArgs"]):] == plan["serveArgs"]
    assert plan["generation"] == 1 and plan["derivation"]
    assert status["selector"] == "app.kubernetes.io/name=kvpilot,app.kubernetes.io/instance=chat," \
                                 "app.kubernetes.io/component=engine"
    assert status["endpoint"] == "http://chat.team-a.svc.cluster.local:80/v1"
    for child in children.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["kind"], ref["controller"]) == (cr["metadata"]["uid"], c.KIND, True)
    assert [e["reason"] for e in cluster.events("chat")] == ["Planned"]


def test_an_unchanged_service_costs_no_writes(cluster):
    wait_for(lambda: cluster.condition("chat", "Planned"), what="chat planned")
    cluster.settle(1)
    mark = cluster.writes()
    cluster.settle(3)  # three full reconcile passes, each reading every child
    assert cluster.writes_since(mark) == []


def test_spec_update_changes_the_args_and_advances_the_generation(cluster):
    before = cluster.children("chat")["Deployment"]
    cluster.kubectl("patch", "inferenceservice", "chat", "--type", "merge",
                    "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 6}}}))
    wait_for(lambda: (cr := cluster.cr("chat"))["status"]["observedGeneration"] == 2 and cr,
             what="observedGeneration 2")
    deployment = wait_for(lambda: (d := cluster.children("chat")["Deployment"]) and
                          _flag(_args(d), "--max-num-seqs") == "6" and d, what="new args")
    assert deployment["metadata"]["generation"] == before["metadata"]["generation"] + 1  # a rollout
    plan = wait_for(lambda: (p := cluster.cr("chat")["status"]["plan"])["generation"] == 2 and p)
    assert plan["maxNumSeqs"] == 6 and "--max-num-seqs" in plan["serveArgs"]
    conditions = cluster.cr("chat")["status"]["conditions"]
    assert {cond["observedGeneration"] for cond in conditions} == {2}


def test_a_deleted_child_is_recreated(cluster):
    old = cluster.children("chat")
    cluster.kubectl("delete", "service", "chat", "--wait=false")
    cluster.kubectl("delete", "deployment", "chat", "--wait=false")
    new = wait_for(lambda: (ch := cluster.children("chat")) and "Service" in ch and "Deployment" in ch and ch,
                   what="recreated children")
    assert new["Service"]["metadata"]["uid"] != old["Service"]["metadata"]["uid"]
    assert _args(new["Deployment"]) == _args(old["Deployment"])


def test_drift_is_repaired_and_removed_fields_are_removed(cluster):
    cluster.kubectl("patch", "deployment", "chat", "--type", "json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/template/spec/containers/0/args/1", "value": "/tampered"}]))
    wait_for(lambda: _args(cluster.children("chat")["Deployment"])[1] == "/models/model", what="repair")
    cluster.kubectl("patch", "inferenceservice", "chat", "--type", "merge",
                    "-p", json.dumps({"spec": {"nodeSelector": {"pool": "gpu", "zone": "a"}}}))
    wait_for(lambda: cluster.children("chat")["Deployment"]["spec"]["template"]["spec"].get("nodeSelector")
             == {"pool": "gpu", "zone": "a"}, what="nodeSelector applied")
    cluster.kubectl("patch", "inferenceservice", "chat", "--type", "merge",
                    "-p", json.dumps({"spec": {"nodeSelector": {"zone": None}}}))
    wait_for(lambda: cluster.children("chat")["Deployment"]["spec"]["template"]["spec"].get("nodeSelector")
             == {"pool": "gpu"}, what="nodeSelector key removed")


def test_ready_follows_the_deployment_status(cluster):
    replicas = cluster.children("chat")["Deployment"]["spec"]["replicas"]
    status = {"status": {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas,
                         "observedGeneration": cluster.children("chat")["Deployment"]["metadata"]["generation"]}}
    cluster.kubectl("patch", "deployment", "chat", "--subresource=status", "--type", "merge",
                    "-p", json.dumps(status))
    ready = cluster.wait_condition("chat", "Ready", "True")
    assert ready["reason"] == "AllReplicasReady"
    assert cluster.condition("chat", "Progressing")["status"] == "False"
    assert cluster.cr("chat")["status"]["readyReplicas"] == replicas
    table = cluster.kubectl("get", "inferenceservices", "chat").stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "GPU", "KV-DTYPE", "MAX-SEQS", "READY-REPLICAS", "REPLICAS",
                                "READY", "AGE"]
    assert table[1].split()[1:8] == ["hf://Qwen/Qwen3-0.6B", "l4", "auto", "6", str(replicas), str(replicas),
                                     "True"]


def test_an_infeasible_spec_is_reported_and_builds_nothing(cluster):
    cluster.apply("too-big", INFEASIBLE)
    planned = cluster.wait_condition("too-big", "Planned", "False")
    assert planned["reason"] == "Infeasible" and "gpu_memory" in planned["message"]
    error = cluster.cr("too-big")["status"]["planError"]
    assert error["bindingConstraint"] == "gpu_memory" and error["suggestions"]
    cluster.settle(2)
    assert cluster.children("too-big") == {}
    events = wait_for(lambda: cluster.events("too-big"), what="an Event")
    assert [(e["type"], e["reason"]) for e in events] == [("Warning", "Infeasible")]  # once, not per pass
    assert "plan" not in cluster.cr("too-big")["status"]


def test_an_infeasible_update_leaves_the_running_children_alone(cluster):
    before = cluster.children("chat")
    plan_before = cluster.cr("chat")["status"]["plan"]
    mark = cluster.writes()
    cluster.kubectl("patch", "inferenceservice", "chat", "--type", "merge", "-p", json.dumps(
        {"spec": {"model": {"uri": "hf://Qwen/Qwen3-32B"}, "engine": {"maxNumSeqs": None}}}))
    cluster.wait_condition("chat", "Planned", "False")
    cluster.settle(2)
    after = cluster.children("chat")
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == \
        {k: v["metadata"]["resourceVersion"] for k, v in before.items()}
    child_writes = [w for w in cluster.writes_since(mark) if "/inferenceservices/" not in w.path
                    and "/events" not in w.path]
    assert child_writes == []
    assert cluster.cr("chat")["status"]["plan"] == plan_before  # what the running pods were given
    cluster.kubectl("patch", "inferenceservice", "chat", "--type", "merge",
                    "-p", json.dumps({"spec": {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}}}))
    cluster.wait_condition("chat", "Planned", "True")
    status = wait_for(lambda: "planError" not in (st := cluster.cr("chat")["status"]) and st,
                      what="planError cleared")
    assert status["plan"]["generation"] == status["observedGeneration"] == cluster.cr("chat")["metadata"]["generation"]


def test_a_spec_the_planner_cannot_read_is_invalid(cluster):
    cluster.apply("mystery", {**SMALL, "model": {"uri": "pvc://models/my-finetune"}})
    planned = cluster.wait_condition("mystery", "Planned", "False")
    assert planned["reason"] == "InvalidSpec" and "spec.model.architecture" in planned["message"]
    assert cluster.children("mystery") == {}


def test_an_object_controlled_by_someone_else_is_not_taken_over(cluster):
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "clash", "namespace": NS, "ownerReferences": [
                   {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "other", "uid": "other-uid",
                    "controller": True}]},
               "spec": {"ports": [{"port": 1234}]}}
    cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(foreign))
    cluster.apply("clash", SMALL)
    degraded = cluster.wait_condition("clash", "Degraded", "True")
    assert "already controlled by ReplicaSet other" in degraded["message"]
    assert cluster.obj("services", "clash")["spec"]["ports"] == [{"port": 1234}]
    assert "Deployment" in cluster.children("clash")  # the rest is still built


def test_scale_subresource_sets_the_replicas(cluster):
    cluster.kubectl("scale", "inferenceservice", "chat", "--replicas=3")
    deployment = wait_for(lambda: (d := cluster.children("chat")["Deployment"])["spec"]["replicas"] == 3 and d,
                          what="3 replicas")
    assert deployment
    wait_for(lambda: "PodDisruptionBudget" in cluster.children("chat"), what="a PDB")
    cluster.kubectl("scale", "inferenceservice", "chat", "--replicas=1")
    wait_for(lambda: "PodDisruptionBudget" not in cluster.children("chat"), what="PDB removed")


def test_the_autoscaler_owns_the_replica_count(cluster):
    spec = yaml.safe_load((crd_schema.ROOT / "crds/examples/autoscaled-kv-usage.yaml").read_text())["spec"]
    cluster.apply("scaled", spec)
    children = wait_for(lambda: (ch := cluster.children("scaled")) and "HorizontalPodAutoscaler" in ch and ch,
                        what="an HPA")
    assert children["HorizontalPodAutoscaler"]["spec"]["maxReplicas"] == 6
    cluster.kubectl("patch", "deployment", "scaled", "--subresource=scale", "--type", "merge",
                    "-p", '{"spec":{"replicas":5}}')  # what the HPA controller does
    mark = cluster.writes()
    cluster.settle(2)
    assert cluster.children("scaled")["Deployment"]["spec"]["replicas"] == 5
    assert [w for w in cluster.writes_since(mark) if "/deployments/" in w.path] == []
    cluster.kubectl("patch", "inferenceservice", "scaled", "--type", "merge",
                    "-p", '{"spec":{"autoscaling":{"mode":"none"}}}')
    wait_for(lambda: "HorizontalPodAutoscaler" not in cluster.children("scaled"), what="HPA removed")


def test_podmonitor_and_scaledobject_appear_with_their_apis(cluster):
    def minimal_crd(group, kind, plural):
        return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{group}"},
                "spec": {"group": group, "scope": "Namespaced",
                         "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                         "versions": [{"name": "v1" if "monitoring" in group else "v1alpha1", "served": True,
                                       "storage": True, "schema": {"openAPIV3Schema": {
                                           "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}

    cluster.apply("kedaed", {**SMALL, "autoscaling": {"mode": "keda", "maxReplicas": 3}})
    degraded = cluster.wait_condition("kedaed", "Degraded", "True")
    assert degraded["reason"] == "ApplyFailed" and "ScaledObject" in degraded["message"]
    for crd in (minimal_crd("keda.sh", "ScaledObject", "scaledobjects"),
                minimal_crd("monitoring.coreos.com", "PodMonitor", "podmonitors")):
        cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(crd))
    children = wait_for(lambda: (ch := cluster.children("kedaed")) and {"ScaledObject", "PodMonitor"} <= set(ch)
                        and ch, what="ScaledObject and PodMonitor")
    assert children["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == "kedaed"
    cluster.wait_condition("kedaed", "Degraded", "False")
    events = [(e["type"], e["reason"]) for e in cluster.events("kedaed")]
    assert events == [("Normal", "Planned"), ("Warning", "ApplyFailed"), ("Normal", "Recovered")]
    wait_for(lambda: "PodMonitor" in cluster.children("chat"), what="PodMonitor for existing services too")


def test_an_operator_restart_resumes_without_writes(cluster):
    cluster.apply("restarted", SMALL)
    cluster.wait_condition("restarted", "Planned", "True")
    cluster.quiesce()
    cluster.operator.stop()
    mark = cluster.writes()
    cluster.operator.start()
    wait_for(lambda: cluster.operator.log().count("Handler 'build_registry.<locals>.reconcile_spec' succeeded")
             >= 1 and cluster.timer_runs() >= 2, what="resume handlers")
    cluster.settle(2)
    writes = cluster.writes_since(mark)
    assert [w for w in writes if "/inferenceservices/" not in w.path] == []  # no child writes
    assert [w for w in writes if w.path.endswith("/status")] == []  # no status rewrites
    assert writes == [], [(w.method, w.path, w.body) for w in writes]


def test_deleting_during_a_slow_observer_pass_is_not_held_up(cluster):
    """kopf waits for a running timer before releasing its finalizer; that wait is short."""
    cluster.apply("slow", SMALL)
    wait_for(lambda: "Deployment" in cluster.children("slow"), what="children")
    cluster.emu.run(lambda e: e.latency.update({"/deployments/slow": 2.0}))  # every pass now ~2 s
    try:
        def invoked() -> int:
            return cluster.operator.log().count("Timer 'build_registry.<locals>.observe' is invoked")
        before = invoked()
        wait_for(lambda: invoked() > before, 10, 0.02, "a pass to start")  # now it is in flight
        started = time.monotonic()
        cluster.kubectl("delete", "inferenceservice", "slow", "--wait=false")
        wait_for(lambda: cluster.cr("slow") is None, 15, 0.1, "the finalizer released")
        assert time.monotonic() - started < 8  # kopf's default would poll after 60 s
    finally:
        cluster.emu.run(lambda e: e.latency.clear())


def test_deleting_the_service_deletes_its_children(cluster):
    cluster.apply("doomed", {**SMALL, "replicas": 2})
    children = wait_for(lambda: (ch := cluster.children("doomed")) and len(ch) >= 3 and ch,
                        what="Deployment, Service and PDB")
    cr = cluster.cr("doomed")
    assert cr["metadata"]["finalizers"] == [c.FINALIZER]  # kopf's, for the observer timer
    for child in children.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["name"], ref["blockOwnerDeletion"]) == (cr["metadata"]["uid"], "doomed", True)
    cluster.kubectl("delete", "inferenceservice", "doomed", "--wait=false")
    wait_for(lambda: cluster.cr("doomed") is None, what="the finalizer released")
    wait_for(lambda: cluster.children("doomed") == {}, what="children garbage-collected")
