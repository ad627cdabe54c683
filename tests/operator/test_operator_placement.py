"""The real operator process against the API emulator: GPU placement in the pods it builds,
and Pending pods reported with the scheduler's reason.

Its own emulator and operator (the fixtures of conftest.py, as test_operator.py's: each test starts
from an empty namespace), so that the other module's services do not interfere; objects are
written with the real kubectl.
"""

from __future__ import annotations

import json

import pytest
import yaml

from kvpilot.operator import constants as c

from support.harness import wait_for
from support.kube_scheduler import gpu_node
from support.operator_cluster import NS, SMALL

pytestmark = pytest.mark.slow

NO_MATCH = ("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
            "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling.")


def _pod_status(phase: str, scheduled: dict) -> str:
    return json.dumps({"status": {"phase": phase, "conditions": [{"type": "PodScheduled", **scheduled}]}})


def test_pending_pods_that_no_node_matches_are_reported(cluster):
    cluster.apply("placed", SMALL)
    deployment = wait_for(lambda: cluster.children("placed").get("Deployment"), what="the Deployment")
    template = deployment["spec"]["template"]
    (term,) = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.product", "operator": "In",
                                         "values": ["NVIDIA-L4"]}]
    # the pod the ReplicaSet would create, which kube-scheduler cannot place
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "placed-7d9c-x2x", "namespace": NS, "labels": template["metadata"]["labels"]},
           "spec": template["spec"]}
    cluster.kubectl("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(pod))
    try:
        cluster.kubectl("patch", "pod", "placed-7d9c-x2x", "--subresource=status", "--type", "merge", "-p",
                        _pod_status("Pending", {"status": "False", "reason": "Unschedulable",
                                                "message": NO_MATCH}))
        degraded = cluster.wait_condition("placed", "Degraded", "True")
        assert degraded["reason"] == "NoMatchingNodes"
        assert "nvidia.com/gpu.product in (NVIDIA-L4)" in degraded["message"] and NO_MATCH in degraded["message"]
        events = wait_for(lambda: [(e["type"], e["reason"]) for e in cluster.events("placed")
                                   if e["reason"] == "NoMatchingNodes"], what="an Event")
        assert events == [("Warning", "NoMatchingNodes")]
        # a node with the GPU joined: the pod is scheduled and the condition clears
        cluster.kubectl("patch", "pod", "placed-7d9c-x2x", "--subresource=status", "--type", "merge", "-p",
                        _pod_status("Running", {"status": "True", "reason": None, "message": None}))
        cleared = cluster.wait_condition("placed", "Degraded", "False")
        assert cleared["reason"] == "AsExpected"
        # kopf posts Events in the background, after the status write: wait for it
        wait_for(lambda: ("Normal", "Recovered") in [(e["type"], e["reason"]) for e in cluster.events("placed")],
                 what="the Recovered Event")
    finally:
        cluster.kubectl("delete", "pod", "placed-7d9c-x2x", "--wait=false")


def test_the_spec_override_reaches_the_running_deployment(cluster):
    assert "affinity" in cluster.create("overridden")["Deployment"]["spec"]["template"]["spec"]
    cluster.kubectl("patch", "inferenceservice", "overridden", "--type", "merge", "-p", json.dumps(
        {"spec": {"gpu": {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}}}}))
    pod = wait_for(lambda: (d := cluster.children("overridden")["Deployment"]["spec"]["template"]["spec"])
                   .get("nodeSelector") and d, what="the override applied")
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert "affinity" not in pod  # removed: the operator no longer applies it
    assert cluster.children("overridden")["Deployment"]["metadata"]["labels"][c.LABEL_INSTANCE] == "overridden"


def _hog(node: str) -> dict:
    """Another team's pod holding every GPU of ``node`` (bound there, running)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"hog-{node}", "namespace": "other"},
            "spec": {"nodeName": node, "containers": [{"name": "train", "image": "registry.example/train:1",
                                                       "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}


def _unschedulable_events(cluster, name: str) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in cluster.events(name) if e["reason"] in ("Unschedulable",
                                                                                     "NoMatchingNodes")]


def test_a_full_gpu_node_beside_other_gpu_types_is_reported_as_capacity(cluster):
    """Issue 43: with the L4 node full and an H100 node beside it, kube-scheduler's message
    names both ("1 Insufficient nvidia.com/gpu, 1 node(s) didn't match ..."): the service is
    Unschedulable (capacity), not NoMatchingNodes."""
    nodes = [gpu_node("gpu-h100", "NVIDIA-H100-80GB-HBM3"), gpu_node("gpu-l4", "NVIDIA-L4")]
    for node in nodes:
        cluster.add_node(node)
    cluster.add("pods", _hog("gpu-l4"), "other")
    try:
        cluster.create("full")
        cluster.engine_pod("full", "full-5d8f-a1")
        message = cluster.schedule()[(NS, "full-5d8f-a1")]
        assert message == ("0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match "
                           "Pod's node affinity/selector. preemption: 0/2 nodes are available: 1 No preemption "
                           "victims found for incoming pod, 1 Preemption is not helpful for scheduling.")
        degraded = cluster.wait_condition("full", "Degraded", "True")
        assert degraded["reason"] == "Unschedulable", degraded
        assert "the nodes that match their placement are full (1 Insufficient nvidia.com/gpu)" in degraded["message"]
        assert message in degraded["message"]
        # the other team's job ends: the pod is bound to the L4 node and the condition clears
        cluster.remove("pods", "hog-gpu-l4", "other")
        assert cluster.schedule()[(NS, "full-5d8f-a1")] == "gpu-l4"
        assert cluster.wait_condition("full", "Degraded", "False")["reason"] == "AsExpected"
    finally:
        cluster.remove("pods", "full-5d8f-a1")
        cluster.emu.run(lambda e: [e._delete(e.types[("", "v1", "pods")], "other", n) for (g, p, ns, n) in
                                   list(e.objects) if (p, ns) == ("pods", "other")])
        for node in nodes:
            cluster.remove("nodes", node["metadata"]["name"], None)


def test_twenty_scheduler_messages_of_one_reason_post_one_event(cluster):
    """Issue 43 (Event storms): the scheduler's message changes as nodes come and go, the
    reason does not; the condition's message follows every change, one Event is posted."""
    nodes = [gpu_node("gpu-h100", "NVIDIA-H100-80GB-HBM3")]
    cluster.add_node(nodes[0])
    try:
        cluster.create("stormy")
        cluster.engine_pod("stormy", "stormy-5d8f-a1")
        cluster.schedule()
        assert cluster.wait_condition("stormy", "Degraded", "True")["reason"] == "NoMatchingNodes"
        for i in range(20):  # H100 nodes join one by one (a cluster autoscaler's node group)
            nodes.append(gpu_node(f"gpu-h100-{i}", "NVIDIA-H100-80GB-HBM3"))
            cluster.add_node(nodes[-1])
            cluster.schedule()
            expected = f"0/{len(nodes)} nodes are available: {len(nodes)} node(s) didn't match"
            wait_for(lambda: expected in cluster.condition("stormy", "Degraded")["message"],  # noqa: B023
                     what=f"message {i + 1} in the condition")
        assert cluster.condition("stormy", "Degraded")["reason"] == "NoMatchingNodes"
        wait_for(lambda: _unschedulable_events(cluster, "stormy"), what="the first Event")
        cluster.quiesce()   # kopf posts Events after the status write: let any others arrive
        assert _unschedulable_events(cluster, "stormy") == [("Warning", "NoMatchingNodes")]
    finally:
        cluster.remove("pods", "stormy-5d8f-a1")
        for node in nodes:
            cluster.remove("nodes", node["metadata"]["name"], None)
