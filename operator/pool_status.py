"""What a disaggregated service's two pools show (``spec.disaggregation``): each pool's
Deployment state, ``status.disaggregation``, and the workload conditions of both together.

A request needs a prefill pod and a decode pod, so the service is Ready only while each
pool has a ready replica; Progressing and Degraded are those of the two Deployments
together (a rollout of either is one of the service).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.resources.pools import DECODE, PREFILL, pool_name
from kvpilot.operator.status import Condition, DeploymentState

POOLS = (PREFILL, DECODE)


def pool_states(get: Callable[[str], Mapping[str, Any] | None], owner) -> dict[str, DeploymentState]:
    """Each pool's Deployment state; ``get(name)`` returns the Deployment as last seen."""
    return {role: DeploymentState.read(get(pool_name(owner, role))) for role in POOLS}


def combined(states: Mapping[str, DeploymentState]) -> DeploymentState:
    """Both pools as one workload: every pool must exist; counts add up; a rollout of either
    is one of the service; the first failure is reported."""
    parts = list(states.values())
    # a pool's spec change its controller has not acted on yet: a generation not observed
    pending = any(s.exists and s.rolling_out for s in parts)
    return DeploymentState(
        exists=all(s.exists for s in parts), desired=sum(s.desired for s in parts),
        replicas=sum(s.replicas for s in parts), ready=sum(s.ready for s in parts),
        updated=sum(s.updated for s in parts), generation=1 if pending else None,
        observed_generation=0 if pending else None,
        failure=next((s.failure for s in parts if s.failure), None))


def ready_condition(states: Mapping[str, DeploymentState], overall: Condition) -> Condition:
    """``overall`` (both pools' Ready), unless a pool that should run has no ready replica:
    then no request can be served."""
    empty = [role for role, s in states.items() if s.exists and s.desired > 0 and s.ready == 0]
    if overall.status != "True" or not empty:
        return overall
    counts = ", ".join(f"{role} {s.ready}/{s.desired}" for role, s in states.items())
    return Condition(c.READY, "False", f"No{empty[0].capitalize()}ReplicasReady",
                     f"a request needs a ready replica of each pool: {counts} replicas ready")


def pools_status(states: Mapping[str, DeploymentState]) -> dict[str, dict[str, int]]:
    """``status.disaggregation``."""
    return {role: {"replicas": s.replicas if s.exists else 0, "readyReplicas": s.ready if s.exists else 0,
                   "desiredReplicas": s.desired if s.exists else 0} for role, s in states.items()}
