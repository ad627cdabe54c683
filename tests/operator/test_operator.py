"""The real operator process (``kvpilot operator``) against the API emulator on loopback.

One emulator and one operator serve the module (start-up costs ~1.5 s), but every test
stands alone: it creates the InferenceServices it needs under names of its own, and the
``cluster`` fixture deletes them all afterwards (waiting for the garbage collector), so
each test starts from an empty, quiet namespace in any order. A
test that changes the cluster itself (installs CRDs) gets a cluster of its own. Objects
are created and changed with the real kubectl, observed in the emulator's store, and
writes are counted at the emulator.
"""

from __future__ import annotations

import json
import re
import time
from decimal import Decimal

import pytest
import yaml

from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator import constants as c
from kvpilot.operator.spec import parse_spec

from support import crd_schema
from support.deputy_specs import DEPUTY_SPECS, GOOD
from support.harness import (
    schemaless_crd,
    wait_for,
)
from support.operator_cluster import INFEASIBLE, NS, SMALL

pytestmark = pytest.mark.slow


def _args(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_create_builds_children_with_the_planned_args(cluster):
    children = cluster.create("chat")
    planned = cluster.condition("chat", "Planned")
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
    events = wait_for(lambda: cluster.events("chat"), what="the Planned Event")  # posted after the status
    assert [e["reason"] for e in events] == ["Planned"]


def test_every_engine_pod_is_fenced_under_its_own_account_without_a_token(cluster):
    children = cluster.create("fenced", GOOD)
    children = wait_for(lambda: (ch := cluster.children("fenced")) and
                        {"ServiceAccount", "NetworkPolicy"} <= set(ch) and ch, what="the fence")
    pod = children["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == children["ServiceAccount"]["metadata"]["name"] == "fenced-engine"
    assert children["ServiceAccount"]["automountServiceAccountToken"] is False
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    fence = children["NetworkPolicy"]["spec"]
    assert fence["podSelector"]["matchLabels"].items() <= \
        children["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    assert fence["policyTypes"] == ["Ingress", "Egress"]


@pytest.mark.parametrize("case", DEPUTY_SPECS)
def test_a_confused_deputy_spec_is_refused_with_a_condition_and_creates_nothing(cluster, case):
    spec, reason = DEPUTY_SPECS[case]
    name = f"deputy-{case}"
    cluster.apply(name, spec)
    planned = cluster.wait_condition(name, "Planned", "False")
    assert planned["reason"] == reason and planned["message"].startswith("spec.")
    events = wait_for(lambda: cluster.events(name), what="the refusal's Event")
    assert [(e["type"], e["reason"]) for e in events] == [("Warning", reason)]
    cluster.settle(2)
    assert cluster.children(name) == {}  # nothing was created: no pod, no account, no Secret read
    # a running service changed to ask for too much keeps what it runs
    running = cluster.create(f"{name}-later", GOOD)["Deployment"]
    cluster.apply(f"{name}-later", spec)
    wait_for(lambda: cluster.condition(f"{name}-later", "Planned")["reason"] == reason, what="the refusal")
    cluster.settle(2)
    assert cluster.children(f"{name}-later")["Deployment"]["spec"] == running["spec"]


def test_an_unchanged_service_costs_no_writes(cluster):
    cluster.create("steady")
    cluster.quiesce()
    mark = cluster.writes()
    cluster.settle(3)  # three full reconcile passes, each reading every child
    assert cluster.writes_since(mark) == []


def test_spec_update_changes_the_args_and_advances_the_generation(cluster):
    before = cluster.create("updated")["Deployment"]
    cluster.kubectl("patch", "inferenceservice", "updated", "--type", "merge",
                    "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 6}}}))
    wait_for(lambda: (cr := cluster.cr("updated"))["status"]["observedGeneration"] == 2 and cr,
             what="observedGeneration 2")
    deployment = wait_for(lambda: (d := cluster.children("updated")["Deployment"]) and
                          _flag(_args(d), "--max-num-seqs") == "6" and d, what="new args")
    assert deployment["metadata"]["generation"] == before["metadata"]["generation"] + 1  # a rollout
    plan = wait_for(lambda: (p := cluster.cr("updated")["status"]["plan"])["generation"] == 2 and p)
    assert plan["maxNumSeqs"] == 6 and "--max-num-seqs" in plan["serveArgs"]
    conditions = cluster.cr("updated")["status"]["conditions"]
    assert {cond["observedGeneration"] for cond in conditions} == {2}


def test_a_deleted_child_is_recreated(cluster):
    old = cluster.create("recreated")
    cluster.kubectl("delete", "service", "recreated", "--wait=false")
    cluster.kubectl("delete", "deployment", "recreated", "--wait=false")
    new = wait_for(lambda: (ch := cluster.children("recreated")) and "Service" in ch and "Deployment" in ch
                   and ch["Service"]["metadata"]["uid"] != old["Service"]["metadata"]["uid"] and ch,
                   what="recreated children")
    assert new["Service"]["metadata"]["uid"] != old["Service"]["metadata"]["uid"]
    assert _args(new["Deployment"]) == _args(old["Deployment"])


def test_drift_is_repaired_and_removed_fields_are_removed(cluster):
    assert _args(cluster.create("drifted")["Deployment"])[1] == "/models/model"
    cluster.kubectl("patch", "deployment", "drifted", "--type", "json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/template/spec/containers/0/args/1", "value": "/tampered"}]))
    wait_for(lambda: _args(cluster.children("drifted")["Deployment"])[1] == "/models/model", what="repair")
    cluster.kubectl("patch", "inferenceservice", "drifted", "--type", "merge",
                    "-p", json.dumps({"spec": {"nodeSelector": {"pool": "gpu", "zone": "a"}}}))
    wait_for(lambda: cluster.children("drifted")["Deployment"]["spec"]["template"]["spec"].get("nodeSelector")
             == {"pool": "gpu", "zone": "a"}, what="nodeSelector applied")
    cluster.kubectl("patch", "inferenceservice", "drifted", "--type", "merge",
                    "-p", json.dumps({"spec": {"nodeSelector": {"zone": None}}}))
    wait_for(lambda: cluster.children("drifted")["Deployment"]["spec"]["template"]["spec"].get("nodeSelector")
             == {"pool": "gpu"}, what="nodeSelector key removed")


def test_ready_follows_the_deployment_status(cluster):
    deployment = cluster.create("ready")["Deployment"]
    replicas = deployment["spec"]["replicas"]
    assert cluster.condition("ready", "Ready")["status"] == "False"
    status = {"status": {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas,
                         "observedGeneration": deployment["metadata"]["generation"]}}
    cluster.kubectl("patch", "deployment", "ready", "--subresource=status", "--type", "merge",
                    "-p", json.dumps(status))
    ready = cluster.wait_condition("ready", "Ready", "True")
    assert ready["reason"] == "AllReplicasReady"
    assert cluster.condition("ready", "Progressing")["status"] == "False"
    assert cluster.cr("ready")["status"]["readyReplicas"] == replicas
    table = cluster.kubectl("get", "inferenceservices", "ready").stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "GPU", "KV-DTYPE", "MAX-SEQS", "OBSERVED-KV-TOKENS", "P:D",
                                "READY-REPLICAS", "REPLICAS", "READY", "ADAPTERS", "AGE"]
    max_seqs = str(cluster.cr("ready")["status"]["plan"]["maxNumSeqs"])
    assert table[1].split()[1:8] == ["hf://Qwen/Qwen3-0.6B", "l4", "auto", max_seqs, str(replicas),
                                     str(replicas), "True"]
    observed = table[0].index("OBSERVED-KV-TOKENS")
    assert table[1][observed:table[0].index("READY-REPLICAS")].strip() == ""  # no engine pod read yet


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
    cluster.create("grown")
    cluster.quiesce()
    before = cluster.children("grown")
    plan_before = cluster.cr("grown")["status"]["plan"]
    mark = cluster.writes()
    cluster.kubectl("patch", "inferenceservice", "grown", "--type", "merge", "-p", json.dumps(
        {"spec": {"model": {"uri": "hf://Qwen/Qwen3-32B"}}}))
    cluster.wait_condition("grown", "Planned", "False")
    cluster.settle(2)
    after = cluster.children("grown")
    assert {k: v["metadata"]["resourceVersion"] for k, v in after.items()} == \
        {k: v["metadata"]["resourceVersion"] for k, v in before.items()}
    child_writes = [w for w in cluster.writes_since(mark) if "/inferenceservices/" not in w.path
                    and "/events" not in w.path]
    assert child_writes == []
    assert cluster.cr("grown")["status"]["plan"] == plan_before  # what the running pods were given
    cluster.kubectl("patch", "inferenceservice", "grown", "--type", "merge",
                    "-p", json.dumps({"spec": {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}}}))
    cluster.wait_condition("grown", "Planned", "True")
    status = wait_for(lambda: "planError" not in (st := cluster.cr("grown")["status"]) and st,
                      what="planError cleared")
    assert status["plan"]["generation"] == status["observedGeneration"] == cluster.cr("grown")["metadata"]["generation"]


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
    try:
        cluster.apply("clash", SMALL)
        degraded = cluster.wait_condition("clash", "Degraded", "True")
        assert "already controlled by ReplicaSet other" in degraded["message"]
        assert cluster.obj("services", "clash")["spec"]["ports"] == [{"port": 1234}]
        assert "Deployment" in cluster.children("clash")  # the rest is still built
    finally:
        cluster.kubectl("delete", "service", "clash", "--wait=false")


def test_scale_subresource_sets_the_replicas(cluster):
    assert cluster.create("manual")["Deployment"]["spec"]["replicas"] == 1
    cluster.kubectl("scale", "inferenceservice", "manual", "--replicas=3")
    wait_for(lambda: cluster.children("manual")["Deployment"]["spec"]["replicas"] == 3, what="3 replicas")
    wait_for(lambda: "PodDisruptionBudget" in cluster.children("manual"), what="a PDB")
    cluster.kubectl("scale", "inferenceservice", "manual", "--replicas=1")
    wait_for(lambda: "PodDisruptionBudget" not in cluster.children("manual"), what="PDB removed")


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


def _requests_to(cluster, part: str) -> list[tuple[str, str]]:
    """(method, path) of the requests the operator made whose path holds ``part``."""
    def read(e):
        return [(getattr(r.method, "value", str(r.method)).upper(), r.url.path) for r in list(e)
                if part in r.url.path and r.headers.get("User-Agent") == "kvpilot-operator"]
    return cluster.emu.run(read)


def test_optional_apis_absent_are_one_condition_and_come_alive_when_installed(own_cluster):
    """KEDA, the inference extension (for the gateway router) and the Prometheus operator
    absent: one discovery each, ``Degraded=MissingAPI`` naming what the spec needs, no
    request for their objects (issue 43: a GET + PATCH 404 every 30 s for the ScaledObject);
    their CRDs installed: the children appear within seconds and the condition clears."""
    cluster = own_cluster  # it installs CRDs: every later service would get a PodMonitor
    assert "PodMonitor" not in cluster.create("plain")
    cluster.apply("kedaed", {**SMALL, "autoscaling": {"mode": "keda", "maxReplicas": 3},
                             "routing": {"router": "gateway"}})
    degraded = cluster.wait_condition("kedaed", "Degraded", "True")
    assert degraded["reason"] == "MissingAPI", degraded
    assert "autoscaling.mode: keda needs keda.sh/v1alpha1" in degraded["message"]
    assert "install KEDA (kedacore/keda) or use autoscaling.mode: hpa" in degraded["message"]
    assert "routing.router: gateway" in degraded["message"] and "inference.networking.k8s.io/v1" in \
        degraded["message"]
    assert {"Deployment", "Service"} <= set(cluster.children("kedaed"))   # it serves meanwhile
    cluster.settle(3)
    for part in ("/scaledobjects", "/podmonitors", "/inferencepools"):
        assert _requests_to(cluster, part) == [], part        # nothing asked of an absent API
    assert cluster.condition("kedaed", "Degraded")["reason"] == "MissingAPI"

    installed = time.monotonic()
    for crd in (schemaless_crd("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"),
                schemaless_crd("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors"),
                schemaless_crd("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools")):
        cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(crd))
    children = wait_for(lambda: (ch := cluster.children("kedaed")) and
                        {"ScaledObject", "PodMonitor"} <= set(ch) and cluster.obj("inferencepools", "kedaed")
                        and ch, 10, what="ScaledObject, PodMonitor and InferencePool")
    alive = time.monotonic() - installed
    assert children["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == "kedaed"
    cluster.wait_condition("kedaed", "Degraded", "False")
    print(f"\noptional APIs installed -> children {alive:.2f}s (kubectl included)")
    assert alive < 5
    wait_for(lambda: ("Normal", "Recovered") in [(e["type"], e["reason"]) for e in cluster.events("kedaed")],
             what="the Recovered Event")
    events = [(e["type"], e["reason"]) for e in cluster.events("kedaed")]
    assert events == [("Normal", "Planned"), ("Warning", "MissingAPI"), ("Normal", "Recovered")]
    wait_for(lambda: "PodMonitor" in cluster.children("plain"), what="PodMonitor for existing services too")


def _slo_thresholds(rule: dict) -> dict[str, Decimal]:
    """alert -> the threshold (seconds) its expression compares the p95 with."""
    (group,) = rule["spec"]["groups"]
    return {r["alert"]: Decimal(r["expr"].rsplit(" > ", 1)[1]) for r in group["rules"]}


def test_slo_prometheusrule_follows_the_declared_slo(own_cluster):
    cluster = own_cluster  # it installs the monitoring CRDs: later services would get children
    for kind, plural in (("PodMonitor", "podmonitors"), ("PrometheusRule", "prometheusrules")):
        cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(
            schemaless_crd("monitoring.coreos.com", "v1", kind, plural)))
    slo = {**SMALL["slo"], "ttftP95Ms": 750, "itlP95Ms": 45.5}
    cluster.apply("chat", {**SMALL, "slo": slo}, labels={"team": "search"})
    rule = wait_for(lambda: cluster.children("chat").get("PrometheusRule"), what="the SLO PrometheusRule")
    assert [ref["name"] for ref in rule["metadata"]["ownerReferences"]] == ["chat"]
    assert rule["metadata"]["labels"]["team"] == "search"
    served = parse_spec({**SMALL, "slo": slo}, "chat").model.served_name
    (group,) = rule["spec"]["groups"]
    for r in group["rules"]:
        assert {k: r["labels"][k] for k in ("namespace", "inferenceservice", "model_name")} == \
            {"namespace": NS, "inferenceservice": "chat", "model_name": served}
        assert f'namespace="{NS}",model_name="{served}"' in r["expr"]
    # thresholds are the SLO exactly (milliseconds -> seconds, decimal)
    assert _slo_thresholds(rule) == {"KVPilotTTFTAboveSLO": Decimal("0.75"), "KVPilotITLAboveSLO": Decimal("0.0455")}
    # the SLO changes: the rule follows; the latency targets go: so does the rule
    cluster.apply("chat", {**SMALL, "slo": {**SMALL["slo"], "ttftP95Ms": 300}}, labels={"team": "search"})
    wait_for(lambda: _slo_thresholds(cluster.children("chat").get("PrometheusRule") or
                                     {"spec": {"groups": [{"rules": []}]}}) == {"KVPilotTTFTAboveSLO": Decimal("0.3")},
             what="the PrometheusRule updated to the new SLO")
    cluster.apply("chat", SMALL, labels={"team": "search"})
    wait_for(lambda: "PrometheusRule" not in cluster.children("chat"), what="the PrometheusRule removed")
    assert "PodMonitor" in cluster.children("chat")


def test_an_operator_restart_resumes_without_writes(cluster):
    cluster.apply("restarted", SMALL)
    cluster.wait_condition("restarted", "Planned", "True")
    cluster.quiesce()
    cluster.operator.stop()
    mark = cluster.writes()
    cluster.operator.start()
    wait_for(lambda: cluster.timer_runs() >= 2, what="passes after the restart")
    cluster.settle(2)
    # A restarted operator learns of someone else's object holding a child's name ("clash")
    # by trying to create it (409 AlreadyExists); that is the only attempt allowed.
    writes = [w for w in cluster.writes_since(mark) if not (w.method == "POST" and w.status == 409)]
    assert [w for w in writes if "/inferenceservices/" not in w.path] == []  # no child writes
    assert [w for w in writes if w.path.endswith("/status")] == []  # no status rewrites
    assert writes == [], [(w.method, w.path, w.body) for w in writes]


def test_deleting_during_a_slow_observer_pass_is_not_held_up(cluster):
    """No finalizer holds the object while its worker finishes a slow pass; the worker ends
    after that pass and creates nothing more."""
    cluster.apply("slow", SMALL)
    wait_for(lambda: "Deployment" in cluster.children("slow"), what="children")
    cluster.emu.run(lambda e: e.latency.update({"/deployments/slow": 2.0}))  # a repair takes ~2 s
    try:
        def invoked() -> int:
            return len(re.findall(r"\[team-a/slow\] reconcile pass \d+ starting", cluster.operator.log()))
        before = invoked()
        cluster.kubectl("label", "deployment", "slow", f"{c.LABEL_INSTANCE}=tampered", "--overwrite")
        wait_for(lambda: invoked() > before, 10, 0.02, "a pass to start")  # its PATCH is in flight
        started = time.monotonic()
        cluster.kubectl("delete", "inferenceservice", "slow", "--wait=false")
        wait_for(lambda: cluster.cr("slow") is None, 15, 0.1, "the object deleted")
        assert time.monotonic() - started < 2
        time.sleep(2.5)  # the pass's PATCH lands (it may create the Deployment again: the
        # garbage collector takes a child whose owner is gone)
        wait_for(lambda: cluster.children("slow") == {}, 10, what="children garbage-collected")
    finally:
        cluster.emu.run(lambda e: e.latency.clear())


def test_deleting_the_service_deletes_its_children(cluster):
    cluster.apply("doomed", {**SMALL, "replicas": 2})
    children = wait_for(lambda: (ch := cluster.children("doomed")) and len(ch) >= 3 and ch,
                        what="Deployment, Service and PDB")
    cr = cluster.cr("doomed")
    assert not cr["metadata"].get("finalizers")  # nothing holds its deletion (issue 43)
    for child in children.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["name"], ref["blockOwnerDeletion"]) == (cr["metadata"]["uid"], "doomed", True)
    cluster.kubectl("delete", "inferenceservice", "doomed", "--wait=false")
    wait_for(lambda: cluster.cr("doomed") is None, what="the object deleted")
    wait_for(lambda: cluster.children("doomed") == {}, what="children garbage-collected")
