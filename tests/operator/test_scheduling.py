"""Pending engine pods classified from kube-scheduler's message, and the emulator's scheduler
that writes those messages.

Oracle: the messages a real kube-scheduler (v1.36) wrote for kvpilot's engine pods on a
cluster of one L4 and one H100 node (issue 43), verbatim; the emulator's scheduler must
produce them from Node and Pod objects, and the operator's classification must read them
as a platform engineer would (a full GPU node is a capacity problem, not a label problem).
"""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator.scheduling import FitFailure, scheduling_problem

from support.built import SMALL, build
from support.kube_scheduler import fit_error, gpu_node, place, pod_requests, quantity

# kube-scheduler v1.36, issue 43: the L4 node full, the H100 node of another type
FULL_L4 = ("0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's node "
           "affinity/selector. preemption: 0/2 nodes are available: 1 No preemption victims found for "
           "incoming pod, 1 Preemption is not helpful for scheduling.")
NO_L4 = ("0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector. preemption: 0/2 "
         "nodes are available: 2 Preemption is not helpful for scheduling.")


def _engine_pod() -> dict:
    """The pod the ReplicaSet makes from the operator's engine Deployment (one L4 GPU)."""
    deployment = next(ch.body for ch in build(SMALL) if ch.kind.kind == "Deployment")
    template = copy.deepcopy(deployment["spec"]["template"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "chat-0", "namespace": "team-a",
                                                            **template["metadata"]},
            "spec": template["spec"], "status": {"phase": "Pending"}}


def _pending(message: str) -> dict:
    return {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}}


def test_the_emulated_scheduler_writes_what_kube_scheduler_wrote():
    pod = _engine_pod()
    assert pod_requests(pod)["nvidia.com/gpu"] == 1
    nodes = [gpu_node("gpu-h100", "NVIDIA-H100-80GB-HBM3"), gpu_node("gpu-l4", "NVIDIA-L4")]
    assert place(pod, nodes, {}) == ("gpu-l4", None)
    full = {"gpu-l4": {"nvidia.com/gpu": quantity(8), "pods": quantity(8)}}
    assert place(pod, nodes, full) == (None, FULL_L4)
    assert place(pod, [gpu_node("gpu-h100-a", "NVIDIA-H100-80GB-HBM3"),
                       gpu_node("gpu-h100-b", "NVIDIA-H100-80GB-HBM3")], {}) == (None, NO_L4)
    # the GPU taint untolerated, a cordoned node, a control-plane node: their own reasons
    bare = copy.deepcopy(pod)
    bare["spec"]["tolerations"] = []
    assert place(bare, [gpu_node("gpu-l4", "NVIDIA-L4")], {})[1].startswith(
        "0/1 nodes are available: 1 node(s) had untolerated taint {nvidia.com/gpu: present}. preemption:")
    cordoned = {**gpu_node("gpu-l4", "NVIDIA-L4"), "spec": {"unschedulable": True}}
    assert "1 node(s) were unschedulable" in place(pod, [cordoned], {})[1]
    assert fit_error(3, {"a": ["Insufficient cpu", "Insufficient nvidia.com/gpu"], "b": ["Too many pods"],
                         "c": ["node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }"]}) == (
        "0/3 nodes are available: 1 Insufficient cpu, 1 Insufficient nvidia.com/gpu, 1 Too many pods, "
        "1 node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }. preemption: 0/3 nodes "
        "are available: 1 Preemption is not helpful for scheduling, 2 No preemption victims found for "
        "incoming pod.")


def test_the_message_is_parsed_as_a_histogram():
    fit = FitFailure.parse(FULL_L4)
    assert fit.nodes == 2 and fit.reasons == ((1, "Insufficient nvidia.com/gpu"),
                                              (1, "node(s) didn't match Pod's node affinity/selector"))
    assert fit.capacity == ((1, "Insufficient nvidia.com/gpu"),) and not fit.only_mismatch
    assert FitFailure.parse(NO_L4).only_mismatch
    prefilter = FitFailure.parse("0/2 nodes are available: pod has unbound immediate PersistentVolumeClaims. "
                                 "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.")
    assert prefilter.reasons == () and prefilter.prefilter == "pod has unbound immediate PersistentVolumeClaims"
    assert FitFailure.parse("no nodes available to schedule pods").nodes is None


@pytest.mark.parametrize(("message", "reason"), [
    (FULL_L4, "Unschedulable"),       # issue 43: was NoMatchingNodes ("didn't match" appears)
    (NO_L4, "NoMatchingNodes"),
    ("0/4 nodes are available: 1 node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }, "
     "3 node(s) didn't match Pod's node affinity/selector. preemption: 0/4 nodes are available: "
     "4 Preemption is not helpful for scheduling.", "NoMatchingNodes"),
    ("0/3 nodes are available: 1 Too many pods, 2 node(s) didn't match Pod's node affinity/selector.",
     "Unschedulable"),
    ("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.", "Unschedulable"),
    ("0/2 nodes are available: 1 node(s) were unschedulable, 1 node(s) didn't match Pod's node "
     "affinity/selector.", "Unschedulable"),
    ("0/2 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: 0/2 nodes "
     "are available: 2 Preemption is not helpful for scheduling.", "Unschedulable"),
])
def test_a_full_matching_node_is_capacity_and_only_mismatches_are_no_matching_nodes(message, reason):
    problem = scheduling_problem([_pending(message)], "nvidia.com/gpu.product in (NVIDIA-L4)")
    assert problem.reason == reason and message in problem.message
    if reason == "NoMatchingNodes":
        assert "nvidia.com/gpu.product in (NVIDIA-L4)" in problem.message
    elif FitFailure.parse(message).capacity:
        assert "the nodes that match their placement are full" in problem.message


def test_one_pod_short_of_room_makes_the_service_unschedulable():
    problem = scheduling_problem([_pending(NO_L4), _pending(FULL_L4)])
    assert problem.reason == "Unschedulable" and FULL_L4 in problem.message
    assert problem.message.startswith("2 pod(s) Pending")
