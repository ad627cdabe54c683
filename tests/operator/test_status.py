"""Condition bookkeeping and what the operator reads from its Deployment."""

from __future__ import annotations

import pytest

from kvpilot.operator.reconcile import transition_events
from kvpilot.operator.status import (
    Condition,
    DeploymentState,
    merge_conditions,
    workload_conditions,
)


def test_transition_time_changes_only_with_the_status():
    first = merge_conditions(None, [Condition("Ready", "False", "NoReplicasReady", "0/1")], 1, "T1")
    assert first == [{"type": "Ready", "status": "False", "reason": "NoReplicasReady", "message": "0/1",
                      "lastTransitionTime": "T1", "observedGeneration": 1}]
    reworded = merge_conditions(first, [Condition("Ready", "False", "Other", "still 0/1")], 2, "T2")
    assert reworded[0]["lastTransitionTime"] == "T1"
    assert (reworded[0]["reason"], reworded[0]["observedGeneration"]) == ("Other", 2)
    flipped = merge_conditions(reworded, [Condition("Ready", "True", "AllReplicasReady", "1/1")], 2, "T3")
    assert flipped[0]["lastTransitionTime"] == "T3"


def test_conditions_keep_a_stable_order_and_untouched_types():
    merged = merge_conditions(None, [Condition("Degraded", "False", "AsExpected"),
                                     Condition("Planned", "True", "Planned")], 1, "T")
    merged = merge_conditions(merged, [Condition("Ready", "True", "AllReplicasReady")], 1, "T")
    assert [m["type"] for m in merged] == ["Planned", "Ready", "Degraded"]


def test_condition_values_are_checked():
    with pytest.raises(ValueError):
        Condition("Happy", "True", "x")
    with pytest.raises(ValueError):
        Condition("Ready", "yes", "x")


def _deployment(replicas, ready=0, updated=0, generation=1, observed=1, conditions=()):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed, "conditions": list(conditions)}}


def test_workload_conditions_from_the_deployment():
    def by_type(state, error=None):
        return {c.type: (c.status, c.reason) for c in workload_conditions(state, error)}

    assert by_type(DeploymentState.read(None))["Ready"] == ("False", "DeploymentMissing")
    rolling = by_type(DeploymentState.read(_deployment(2, ready=1, updated=1, generation=3, observed=2)))
    assert rolling == {"Ready": ("True", "MinimumReplicasAvailable"), "Progressing": ("True", "RollingOut"),
                       "Degraded": ("False", "AsExpected")}
    done = by_type(DeploymentState.read(_deployment(2, ready=2, updated=2)))
    assert done["Ready"] == ("True", "AllReplicasReady") and done["Progressing"] == ("False", "RolloutComplete")
    stuck = DeploymentState.read(_deployment(1, conditions=[{"type": "Progressing", "status": "False",
                                                             "reason": "ProgressDeadlineExceeded",
                                                             "message": "timed out"}]))
    assert by_type(stuck)["Degraded"] == ("True", "DeploymentFailing")
    assert by_type(DeploymentState.read(_deployment(0)))["Ready"] == ("False", "ScaledToZero")
    assert by_type(DeploymentState.read(_deployment(1, 1, 1)), "HPA: forbidden")["Degraded"] == \
        ("True", "ApplyFailed")


def test_events_only_on_transitions():
    planned = Condition("Planned", "False", "Infeasible", "gpu_memory: too big")
    degraded = Condition("Degraded", "True", "ApplyFailed", "HPA: forbidden")
    first = transition_events(None, [planned, degraded])
    assert [(e.type, e.reason) for e in first] == [("Warning", "Infeasible"), ("Warning", "ApplyFailed")]
    stored = merge_conditions(None, [planned, degraded], 1, "T")
    assert transition_events(stored, [planned, degraded]) == []  # the next resync: quiet
    recovered = transition_events(stored, [Condition("Planned", "True", "Planned", "ok"),
                                           Condition("Degraded", "False", "AsExpected")])
    assert [(e.type, e.reason) for e in recovered] == [("Normal", "Planned"), ("Normal", "Recovered")]


def test_a_new_message_alone_posts_no_event():
    """The detail that changes (the pending pod count, the scheduler's text) is in the
    message; only a new status or reason is an Event (issue 43: 7 Events in 32 s)."""
    first = Condition("Degraded", "True", "Unschedulable", "1 pod(s) Pending. Scheduler: 0/2 nodes are available")
    stored = merge_conditions(None, [first], 1, "T")
    for message in ("2 pod(s) Pending. Scheduler: 0/2 nodes", "2 pod(s) Pending. Scheduler: 0/3 nodes"):
        assert transition_events(stored, [Condition("Degraded", "True", "Unschedulable", message)]) == []
        assert transition_events(stored, [Condition("Planned", "True", "Planned", "a")]) != []   # new: Planned
    other = transition_events(stored, [Condition("Degraded", "True", "NoMatchingNodes", "no L4 node")])
    assert [(e.type, e.reason) for e in other] == [("Warning", "NoMatchingNodes")]
    planned = merge_conditions(None, [Condition("Planned", "True", "Planned", "8 seqs")], 1, "T")
    assert transition_events(planned, [Condition("Planned", "True", "Planned", "4 seqs")]) == []
