"""The real operator process against the API emulator: scaling keeps the running pods.

``kubectl scale kvis`` (the scale subresource) asks for more or fewer copies of what runs: the
engine flags, and so the pod template the Deployment controller compares to decide which
pods to replace, must stay as they are (issue 43: 1 -> 2 replicas re-planned
``--max-num-seqs 8 -> 4``, ``--kv-cache-dtype fp8 -> auto`` and replaced the running pod). A
re-plan comes with any other spec change, or the ``serving.kvpilot.dev/replan`` annotation.
With an autoscaler the scale subresource is accepted and ignored: a condition says so.
"""

from __future__ import annotations

import json

import pytest

from kvpilot.operator import constants as c

from support.harness import wait_for
from support.operator_cluster import SMALL

pytestmark = pytest.mark.slow

# the model cache on a ReadWriteMany claim: one claim for any count, so the pod's volumes do
# not depend on the replica count either (a ReadWriteOnce cache does: see the last test)
SHARED_CACHE = {**SMALL, "model": {**SMALL["model"], "cache": {"accessMode": "ReadWriteMany"}}}


def _template(cluster, name: str) -> dict:
    return cluster.children(name)["Deployment"]["spec"]["template"]


def _args(template: dict) -> list[str]:
    return next(ct for ct in template["spec"]["containers"] if ct["name"] == c.ENGINE_CONTAINER)["args"]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _scaled(cluster, name: str, replicas: int) -> dict:
    cluster.kubectl("scale", "inferenceservice", name, f"--replicas={replicas}")
    return wait_for(lambda: (d := cluster.children(name)["Deployment"])["spec"]["replicas"] == replicas and d,
                    what=f"{replicas} replicas")


def test_scaling_keeps_the_pod_template_until_a_replan_is_asked_for(cluster):
    cluster.create("steady", SHARED_CACHE)
    before = _template(cluster, "steady")
    plan = cluster.cr("steady")["status"]["plan"]
    assert (_flag(_args(before), "--max-num-seqs"), plan["replicas"]) == ("8", 1)
    for replicas in (2, 3, 1, 2):
        _scaled(cluster, "steady", replicas)
        cluster.settle(2)
        assert _template(cluster, "steady") == before, replicas   # no pod is replaced
        assert cluster.cr("steady")["status"]["plan"]["serveArgs"] == plan["serveArgs"]
    planned = cluster.condition("steady", "Planned")
    assert planned["reason"] == "Planned"
    assert "Scaled to 2 replica(s) without re-planning: the pods keep the flags planned for 1 replica(s)" \
        in planned["message"]
    # asked for: the plan for 2 replicas of the SLO's 8 sequences (4 each) rolls out
    cluster.kubectl("annotate", "inferenceservice", "steady", f"{c.ANNOTATION_REPLAN}=1")
    replanned = wait_for(lambda: (t := _template(cluster, "steady")) != before and t, what="the re-plan")
    assert _flag(_args(replanned), "--max-num-seqs") == "4"
    # the Deployment is written before the status patch that records the plan: wait for it
    wait_for(lambda: cluster.cr("steady")["status"]["plan"].get("plannedFor", {}).get("replicas") == 2,
             what="the status's plan for 2 replicas")
    assert "without re-planning" not in cluster.condition("steady", "Planned")["message"]
    # another spec change re-plans too, for the count of the moment
    _scaled(cluster, "steady", 4)
    cluster.settle(2)
    assert _template(cluster, "steady") == replanned
    cluster.kubectl("patch", "inferenceservice", "steady", "--type", "merge",
                    "-p", json.dumps({"spec": {"slo": {**SMALL["slo"], "concurrency": 16}}}))
    wait_for(lambda: _flag(_args(_template(cluster, "steady")), "--max-num-seqs") == "4"
             and cluster.cr("steady")["status"]["plan"]["plannedFor"]["replicas"] == 4, what="16 / 4 replicas")


def test_scaling_the_issue_example_keeps_the_engine_flags(cluster):
    """The spec of issue 43's run (an hf:// model on its default ReadWriteOnce cache): the
    flags stay; only the cache layout follows the count (one claim cannot be mounted on
    several nodes), which the README's model cache table documents."""
    cluster.create("example")
    args = _args(_template(cluster, "example"))
    _scaled(cluster, "example", 2)
    cluster.settle(2)
    assert _args(_template(cluster, "example")) == args


def test_scaling_an_autoscaled_service_is_ignored_and_says_so(cluster):
    cluster.apply("auto", {**SHARED_CACHE, "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4}})
    wait_for(lambda: "HorizontalPodAutoscaler" in cluster.children("auto"), what="the HPA")
    assert cluster.wait_condition("auto", "ReplicasIgnored", "False")["reason"] == "ReplicasUnset"
    template = _template(cluster, "auto")
    cluster.kubectl("scale", "inferenceservice", "auto", "--replicas=3")     # accepted by the API server
    ignored = cluster.wait_condition("auto", "ReplicasIgnored", "True")
    assert ignored["reason"] == "AutoscalerOwnsReplicas"
    assert ignored["message"].startswith("spec.replicas 3 (kubectl scale kvis) is ignored while "
                                         "autoscaling.mode is hpa: the HorizontalPodAutoscaler sets the count")
    wait_for(lambda: ("Warning", "AutoscalerOwnsReplicas") in [(e["type"], e["reason"])
                                                               for e in cluster.events("auto")], what="an Event")
    assert cluster.children("auto")["Deployment"]["spec"]["replicas"] == 1 and _template(cluster, "auto") == template
    cluster.kubectl("patch", "inferenceservice", "auto", "--type", "merge", "-p", '{"spec":{"replicas":null}}')
    assert cluster.wait_condition("auto", "ReplicasIgnored", "False")["reason"] == "ReplicasUnset"
