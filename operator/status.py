"""Pure status logic: conditions from the plan outcome and the Deployment's state.

Conditions follow the Kubernetes convention: ``lastTransitionTime`` changes only when a
condition's ``status`` changes (a new reason or message alone keeps the old time), and
every condition records the ``observedGeneration`` it was computed for.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.scheduling import SchedulingProblem


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str          # "True" | "False" | "Unknown"
    reason: str
    message: str = ""

    def __post_init__(self) -> None:
        if self.type not in c.CONDITION_TYPES:
            raise ValueError(f"unknown condition type {self.type!r}")
        if self.status not in ("True", "False", "Unknown"):
            raise ValueError(f"condition status must be True/False/Unknown, got {self.status!r}")


def now_rfc3339() -> str:
    """The current UTC time as the API server writes it (seconds, ``Z``)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(current: Sequence[Mapping[str, Any]] | None, updates: Sequence[Condition],
                     generation: int | None, now: str) -> list[dict]:
    """``current`` with ``updates`` applied, in CONDITION_TYPES order.

    Args:
        current: ``status.conditions`` as stored (may be None).
        updates: the conditions to set; types not mentioned are kept as they are.
        generation: ``metadata.generation`` these conditions describe.
        now: timestamp for conditions whose status changes (or that are new).
    """
    by_type = {cond.get("type"): dict(cond) for cond in current or () if isinstance(cond, Mapping)}
    for cond in updates:
        old = by_type.get(cond.type)
        changed = old is None or old.get("status") != cond.status
        entry = {"type": cond.type, "status": cond.status, "reason": cond.reason,
                 "message": cond.message,
                 "lastTransitionTime": now if changed else old.get("lastTransitionTime", now)}
        if generation is not None:
            entry["observedGeneration"] = generation
        by_type[cond.type] = entry
    ordered = [by_type.pop(t) for t in c.CONDITION_TYPES if t in by_type]
    return ordered + list(by_type.values())


@dataclass(frozen=True, slots=True)
class DeploymentState:
    """What the operator reads back from its Deployment.

    Args:
        exists: whether the Deployment is there at all.
        desired: ``spec.replicas``.
        replicas / ready / updated: from ``status``.
        generation / observed_generation: the Deployment's spec generation and what its
            controller has acted on (a rollout is pending while they differ).
        failure: the message of a ReplicaFailure or ProgressDeadlineExceeded condition.
    """

    exists: bool
    desired: int = 0
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    generation: int | None = None
    observed_generation: int | None = None
    failure: str | None = None

    @classmethod
    def read(cls, deployment: Mapping[str, Any] | None) -> DeploymentState:
        """Extract the state from a Deployment object (None when it does not exist)."""
        if deployment is None:
            return cls(exists=False)
        spec = deployment.get("spec") or {}
        status = deployment.get("status") or {}
        failure = None
        for cond in status.get("conditions") or ():
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                failure = cond.get("message") or cond.get("reason") or "ReplicaFailure"
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                failure = cond.get("message") or "rollout exceeded its progress deadline"
        return cls(
            exists=True,
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas") or 0),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            generation=(deployment.get("metadata") or {}).get("generation"),
            observed_generation=status.get("observedGeneration"),
            failure=failure,
        )

    @property
    def rolling_out(self) -> bool:
        pending = (self.generation is not None and
                   (self.observed_generation is None or self.observed_generation < self.generation))
        return pending or self.updated < self.desired or self.ready < self.desired


def workload_conditions(state: DeploymentState, apply_error: str | None = None,
                        scheduling: SchedulingProblem | None = None,
                        missing_api: str | None = None) -> list[Condition]:
    """Ready, Progressing and Degraded from the Deployment (or LeaderWorkerSet), the last
    apply's error, pods the scheduler cannot place and the APIs the service needs that the
    cluster does not serve (``missing_api``: the message, ``optional_apis.missing_message``)."""
    counts = f"{state.ready}/{state.desired} replicas ready"
    if not state.exists:
        ready = Condition(c.READY, "False", "DeploymentMissing", "the engine Deployment does not exist")
    elif state.desired == 0:
        ready = Condition(c.READY, "False", "ScaledToZero", counts)
    elif state.ready >= 1:
        reason = "AllReplicasReady" if state.ready >= state.desired else "MinimumReplicasAvailable"
        ready = Condition(c.READY, "True", reason, counts)
    else:
        ready = Condition(c.READY, "False", "NoReplicasReady", counts)

    if state.exists and state.rolling_out:
        progressing = Condition(c.PROGRESSING, "True", "RollingOut",
                                f"{state.updated}/{state.desired} replicas updated, {counts}")
    else:
        progressing = Condition(c.PROGRESSING, "False", "RolloutComplete" if state.exists else "NoDeployment",
                                counts if state.exists else "")

    if missing_api:
        degraded = Condition(c.DEGRADED, "True", "MissingAPI", missing_api)
    elif apply_error:
        degraded = Condition(c.DEGRADED, "True", "ApplyFailed", apply_error)
    elif scheduling is not None:
        degraded = Condition(c.DEGRADED, "True", scheduling.reason, scheduling.message)
    elif state.failure:
        degraded = Condition(c.DEGRADED, "True", "DeploymentFailing", state.failure)
    else:
        degraded = Condition(c.DEGRADED, "False", "AsExpected", "")
    return [ready, progressing, degraded]
