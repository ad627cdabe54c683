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
    assert "affinity" not in pod  # removed through the last-applied annotation
    assert cluster.children("overridden")["Deployment"]["metadata"]["labels"][c.LABEL_INSTANCE] == "overridden"
