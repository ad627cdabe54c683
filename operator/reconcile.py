"""One reconcile pass: spec -> plan -> children -> status, writing only what differs.

Used by every handler (create, resume, spec update and the periodic observer), so the
same code path builds, repairs and observes. Writes happen only when the server's
state differs from the desired one: an unchanged service costs a few GETs and no write.

- Children are created, or merge-patched when a field the operator sets differs or a
  field it set before is no longer wanted (tracked in a last-applied annotation, as
  ``kubectl apply`` does). Fields listed as create-only (an autoscaled Deployment's
  replica count) are set at creation and then left to their owner. An object of the
  same name controlled by something else is left alone (``Degraded``).
- An invalid or infeasible spec leaves the children as they are (the running pods keep
  the last plan, which ``status.plan`` keeps showing) and sets ``Planned=False``.
- The status patch is the difference between the stored status and the computed one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.diff import contains, diff, drop_path, removals, still_present, union
from kvpilot.operator.kube import KubeApi, KubeError
from kvpilot.operator.resources import DEPLOYMENT, Child, desired_children, possible_children
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.monitoring import PODMONITOR_API
from kvpilot.operator.resources.placement import describe as describe_placement
from kvpilot.operator.resources.service import endpoint
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec_to_plan import PlanOutcome, plan_service
from kvpilot.operator.status import (
    Condition,
    DeploymentState,
    SchedulingProblem,
    merge_conditions,
    now_rfc3339,
    scheduling_problem,
    workload_conditions,
)

logger = logging.getLogger(__name__)

# status keys this operator owns; others (if any) are left alone by status patches
STATUS_KEYS = ("observedGeneration", "conditions", "plan", "planError", "replicas",
               "readyReplicas", "selector", "endpoint")


@dataclass(frozen=True, slots=True)
class Event:
    type: str      # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(slots=True)
class ReconcileResult:
    """What one pass decided: the status merge patch, Events to post, writes made."""

    status_patch: dict = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)


def _last_applied(body: Mapping[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


async def apply_child(api: KubeApi, child: Child, result: ReconcileResult) -> dict:
    """Create ``child`` or patch it where it differs; returns the object as stored."""
    ns = child.body["metadata"]["namespace"]
    path = child.kind.path(ns, child.name)
    managed = child.body
    for dotted in child.create_only:
        managed = drop_path(managed, dotted)
    annotations = {c.ANNOTATION_LAST_APPLIED: _last_applied(managed)}
    managed = union(managed, {"metadata": {"annotations": annotations}})

    actual = await api.get(path)
    if actual is None:
        created = await api.create(child.kind.path(ns), union(child.body, managed))
        result.writes.append(f"created {child.kind.kind} {ns}/{child.name}")
        return created
    ours = {ref.get("uid") for ref in managed["metadata"].get("ownerReferences") or ()}
    for ref in actual.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("controller") and ref.get("uid") not in ours:
            raise KubeError(409, f"already controlled by {ref.get('kind')} {ref.get('name')}; "
                                 "not taking it over")
    stored = (actual.get("metadata", {}).get("annotations") or {}).get(c.ANNOTATION_LAST_APPLIED)
    try:
        previous = json.loads(stored) if stored else {}
    except ValueError:
        previous = {}
    removal = removals(previous, managed)
    if contains(actual, managed) and not still_present(actual, removal):
        return actual
    patched = await api.merge_patch(path, union(removal, managed))
    result.writes.append(f"patched {child.kind.kind} {ns}/{child.name}")
    return patched


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("kind") == c.KIND for ref in refs)


async def _remove_unwanted(api: KubeApi, owner: Owner, wanted: set[tuple[str, str]],
                           result: ReconcileResult) -> None:
    for kind, name in possible_children(owner):
        if (kind.kind, name) in wanted:
            continue
        path = kind.path(owner.namespace, name)
        obj = await api.get(path)  # None also when the kind's API is not installed (KEDA, PodMonitor)
        if obj is not None and _owned_by(obj, owner.uid) and await api.delete(path):
            result.writes.append(f"deleted {kind.kind} {owner.namespace}/{name}")


def _plan_error(outcome: PlanOutcome, generation: int | None) -> dict:
    return {"generation": generation, "reason": outcome.reason, "message": outcome.message,
            "bindingConstraint": outcome.binding_constraint or "",
            "suggestions": list(outcome.suggestions)}


def _status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict:
    """Merge patch over the keys this operator owns (None in ``desired`` = remove)."""
    patch: dict = {}
    for key in STATUS_KEYS:
        value = desired.get(key)
        if value is None:
            if key in current:
                patch[key] = None
        elif isinstance(value, Mapping) and isinstance(current.get(key), Mapping):
            nested = diff(current[key], value)
            if nested:
                patch[key] = nested
        elif current.get(key) != value:
            patch[key] = value
    return patch


async def reconcile(api: KubeApi, body: Mapping[str, Any], settings: OperatorSettings) -> ReconcileResult:
    """Bring ``body``'s children and status in line with its spec.

    Args:
        api: the API client.
        body: the InferenceService as last seen (its status is compared against).
        settings: operator settings.
    Returns:
        the status patch to write (empty when nothing changed), Events for condition
        changes worth one (``transition_events``), and the child writes that were made.
    """
    meta = body.get("metadata") or {}
    owner = Owner(meta["name"], meta["namespace"], meta.get("uid"))
    generation = meta.get("generation")
    current = dict(body.get("status") or {})
    result = ReconcileResult()

    try:
        spec = parse_spec(body.get("spec") or {}, owner.name)
        outcome = plan_service(spec)
    except SpecError as exc:
        spec, outcome = None, PlanOutcome.rejected("InvalidSpec", str(exc))

    desired: dict[str, Any] = {"observedGeneration": generation, "selector": owner.selector,
                               "endpoint": endpoint(owner), "plan": current.get("plan")}
    apply_errors: list[str] = []
    deployment: Mapping[str, Any] | None
    if spec is not None and outcome.sizing is not None:  # feasible
        planned = Condition(c.PLANNED, "True", "Planned", outcome.message)
        podmonitor_api = await api.has_api(*PODMONITOR_API)
        children = desired_children(owner, spec, outcome.sizing, settings, podmonitor_api=podmonitor_api)
        deployment = None
        for child in children:
            # Owner reference + the CR's labels on the child (not on the pod template: a
            # label edit on the InferenceService must not restart GPU pods).
            kopf.adopt(child.body, owner=body)
            try:
                stored = await apply_child(api, child, result)
            except KubeError as exc:  # reported through Degraded (and an Event when it starts)
                apply_errors.append(f"{child.kind.kind} {child.name}: {exc.message}")
                logger.debug("applying %s failed: %s", child.kind.kind, exc)
                continue
            if child.kind is DEPLOYMENT:
                deployment = stored
                desired["plan"] = {**outcome.sizing.status, "generation": generation}
        await _remove_unwanted(api, owner, {(ch.kind.kind, ch.name) for ch in children}, result)
    else:
        planned = Condition(c.PLANNED, "False", outcome.reason, outcome.message)
        desired["planError"] = _plan_error(outcome, generation)
        deployment = await api.get(DEPLOYMENT.path(owner.namespace, owner.name))

    state = DeploymentState.read(deployment)
    desired["replicas"] = state.replicas if state.exists else 0
    desired["readyReplicas"] = state.ready if state.exists else 0
    scheduling = None
    if spec is not None and outcome.sizing is not None and state.exists and state.ready < state.desired:
        scheduling = await _scheduling(api, owner, describe_placement(spec, outcome.sizing.gpu, settings))
    conditions = [planned, *workload_conditions(state, "; ".join(apply_errors) or None, scheduling)]
    desired["conditions"] = merge_conditions(current.get("conditions"), conditions, generation,
                                             now_rfc3339())
    result.status_patch = _status_patch(current, desired)
    result.events = transition_events(current.get("conditions"), conditions)
    return result


async def _scheduling(api: KubeApi, owner: Owner, needs: str) -> SchedulingProblem | None:
    """Why engine pods are Pending, if the scheduler says so (read only while not all are ready)."""
    try:
        pods = await api.list(f"/api/v1/namespaces/{owner.namespace}/pods", owner.selector)
    except KubeError as exc:  # no rights to list pods: say nothing rather than fail the pass
        logger.debug("listing pods failed: %s", exc)
        return None
    return scheduling_problem(pods, needs)


def transition_events(current: Any, conditions: list[Condition]) -> list[Event]:
    """Events for a changed Planned condition and for Degraded turning on or off.

    Only changes post Events, so a spec that stays infeasible or a child that keeps
    failing is reported once, not on every resync.
    """
    old = {cd.get("type"): cd for cd in current or () if isinstance(cd, Mapping)}
    events = []
    for cond in conditions:
        before = old.get(cond.type) or {}
        changed = (before.get("status"), before.get("reason"), before.get("message")) != \
            (cond.status, cond.reason, cond.message)
        if cond.type == c.PLANNED and changed:
            events.append(Event("Normal" if cond.status == "True" else "Warning", cond.reason, cond.message))
        elif cond.type == c.DEGRADED and changed and cond.status == "True":
            events.append(Event("Warning", cond.reason, cond.message))
        elif cond.type == c.DEGRADED and before.get("status") == "True" and cond.status == "False":
            events.append(Event("Normal", "Recovered", "no longer degraded"))
    return events
