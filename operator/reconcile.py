"""One reconcile pass: spec -> plan -> children -> status, writing only what differs.

Used for every reason a service is looked at (created, spec changed, a child changed or
disappeared, the periodic safety-net resync), so the same code path builds, repairs and
observes. Children are read from the watch cache (``children.Children``) and optional APIs
from the discovery cache, so an unchanged service costs no API request at all; writes
happen only where the server's state differs from the desired one.

- Children are written with server-side apply (``server_side_apply``) when a field the
  operator sets differs or one it set before is no longer wanted; fields other managers
  own (a sidecar, env a secrets agent injects, an annotation) are theirs and never count
  as drift. Fields listed as create-only (an autoscaled Deployment's replica count) are
  set at creation and then left to their owner, and never removed when they stop being
  managed (``replica_handover``). An object of the same name controlled by something
  else is left alone (``Degraded``).
- An invalid or infeasible spec leaves the children as they are (the running pods keep
  the last plan, which ``status.plan`` keeps showing) and sets ``Planned=False``.
- The status patch is the difference between the stored status and the computed one.
- API failures do not raise: each becomes a ``Failure`` (the pass goes on with the other
  children, except after a 429, which ends the pass's writes at once) and ``Degraded``
  says what failed; the caller retries (``ReconcileResult.retry``).
- Status tells what exists: when applying the Deployment fails, replicas and readiness
  come from the Deployment as last seen, not from "missing".
- Other projects' APIs (LeaderWorkerSet, KEDA, the inference extension, the Prometheus
  operator) are discovered once per pass from a cache (``optional_apis``): children of an
  API not served are not written, read or deleted; an API the spec needs and the cluster
  lacks is ``Degraded`` ``MissingAPI`` (a plan whose replicas span nodes builds nothing
  without LeaderWorkerSet: no Deployment in its place either); installing its CRD
  reconciles every service again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.adapter_loader import (
    FAILED,
    READY,
    AdapterLoader,
    AdapterStatus,
    AdapterTarget,
    ready_total,
)
from kvpilot.operator.children import Children
from kvpilot.operator.discovery import Discovery
from kvpilot.operator.engine_observer import EngineObserver, engine_pods
from kvpilot.operator.kube_api import FOREIGN_CONTROLLER, KubeError
from kvpilot.operator.merge_patch import diff
from kvpilot.operator.optional_apis import (
    INFERENCE,
    KEDA,
    PROMETHEUS,
    MissingApi,
    missing_apis,
    missing_message,
    served_apis,
)
from kvpilot.operator.pool_status import combined, pool_states, pools_status, ready_condition
from kvpilot.operator.replica_handover import inherited_replicas
from kvpilot.operator.resources import (
    DEPLOYMENT,
    WORKLOADS,
    Child,
    desired_children,
    possible_children,
    workload_kind,
    workload_name,
)
from kvpilot.operator.resources.adapters import adapter_paths
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.resources.placement import describe as describe_placement
from kvpilot.operator.resources.pools import most_pods, pool_name
from kvpilot.operator.resources.router import router_endpoint
from kvpilot.operator.resources.service import endpoint
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.scaling import kept_plan_note, plan_input, replicas_ignored
from kvpilot.operator.scheduling import scheduling_problem
from kvpilot.operator.security import check_spec
from kvpilot.operator.server_side_apply import applied_config, holds
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.sizing_drift import SizingObservation, sizing_observation
from kvpilot.operator.spec import InferenceServiceSpec, SpecError, parse_spec
from kvpilot.operator.spec_to_plan import PlanOutcome, plan_service
from kvpilot.operator.status import (
    Condition,
    DeploymentState,
    merge_conditions,
    now_rfc3339,
    workload_conditions,
)

logger = logging.getLogger(__name__)

# status keys this operator owns; others (if any) are left alone by status patches
STATUS_KEYS = ("observedGeneration", "conditions", "plan", "planError", "replicas",
               "readyReplicas", "selector", "endpoint", "observed", "adapters", "adaptersReady",
               "disaggregation", "prefixCache")


@dataclass(frozen=True, slots=True)
class Event:
    type: str      # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Failure:
    """An API call of the pass that failed: what it was for, and the error."""

    what: str        # "Deployment chat"
    error: KubeError

    def __str__(self) -> str:
        return f"{self.what}: {self.error}"


@dataclass(frozen=True, slots=True)
class ServiceFigures:
    """One pass's figures of the service for the operator's gauges and counters.

    Args:
        model_name: the engines' ``model_name`` label (None when the spec does not parse).
        replicas / desired_replicas: the Deployment's ``status.replicas`` / ``spec.replicas``.
        max_replicas: the autoscaler's ceiling, else the fixed count (None: no valid spec).
        plan_outcome: ``feasible`` or ``infeasible``; ``plan_reason`` the Planned condition's
            reason (an infeasible plan's binding constraint).
        sizing_drift: whether SizingDrift is True (None: not observed).
    """

    model_name: str | None
    replicas: int
    desired_replicas: int
    max_replicas: int | None
    plan_outcome: str
    plan_reason: str
    sizing_drift: bool | None = None


@dataclass(slots=True)
class ReconcileResult:
    """What one pass decided: the status merge patch, Events to post, writes made, failures."""

    status_patch: dict = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    sizing: SizingObservation | None = None  # planned vs observed KV capacity (observer on)
    figures: ServiceFigures | None = None
    missing_apis: list[MissingApi] = field(default_factory=list)  # needed, not served (optional_apis)
    adapters_settling: bool = False          # adapters being loaded (or waiting for pods): look again soon

    @property
    def retry(self) -> bool:
        """Whether a failure may go away by itself soon (retry with backoff), as opposed to
        one that needs a change (a missing API, a forbidden or invalid object)."""
        return any(f.error.transient for f in self.failures)

    @property
    def retry_after(self) -> float | None:
        """The longest ``Retry-After`` the API server asked for, if any."""
        return max((f.error.retry_after for f in self.failures if f.error.retry_after is not None),
                   default=None)

    @property
    def throttled(self) -> bool:
        return any(f.error.status == 429 for f in self.failures)


async def apply_child(children: Children, child: Child, result: ReconcileResult) -> Mapping[str, Any]:
    """Server-side apply ``child`` unless the live object holds it already; returns the
    object as stored.

    The object is looked up in the watch cache; one the cache does not show (absent, or
    someone else's object of that name, which lacks our labels) is read by name first, so
    that an object another controller controls is never merged into.
    """
    ns = child.body["metadata"]["namespace"]
    actual = children.get(child.kind, ns, child.name)
    if actual is None:
        actual = await children.fetch(child.kind, ns, child.name)
    if actual is not None:
        ours = {ref.get("uid") for ref in child.body["metadata"].get("ownerReferences") or ()}
        for ref in actual.get("metadata", {}).get("ownerReferences") or ():
            if ref.get("controller") and ref.get("uid") not in ours:
                raise KubeError(409, f"already controlled by {ref.get('kind')} {ref.get('name')}; "
                                     "not taking it over", reason=FOREIGN_CONTROLLER)
    config = applied_config(child, actual)
    if actual is not None and holds(actual, config, child.kind.kind):
        return actual
    applied = await children.apply(child.kind, ns, child.name, config)
    result.writes.append(f"{'patched' if actual is not None else 'created'} {child.kind.kind} {ns}/{child.name}")
    return applied


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("kind") == c.KIND for ref in refs)


async def _remove_unwanted(children: Children, owner: Owner, wanted: set[tuple[str, str]],
                           absent_apis: set[str], result: ReconcileResult) -> None:
    """Delete the owner's children that are not ``wanted``; a kind whose API the cluster no
    longer serves has nothing left to delete (its CRD went, and its objects with it, even
    where the operator still remembers writing one)."""
    for kind, name in possible_children(owner):
        if (kind.kind, name) in wanted or kind.group in absent_apis:
            continue
        obj = children.get(kind, owner.namespace, name)
        if obj is None or not _owned_by(obj, owner.uid):
            continue
        try:
            if await children.delete(kind, owner.namespace, name):
                result.writes.append(f"deleted {kind.kind} {owner.namespace}/{name}")
        except KubeError as exc:
            result.failures.append(Failure(f"deleting {kind.kind} {name}", exc))
            if exc.status == 429:
                return


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


async def reconcile(children: Children, discovery: Discovery, body: Mapping[str, Any],
                    settings: OperatorSettings, observer: EngineObserver | None = None,
                    adapter_loader: AdapterLoader | None = None) -> ReconcileResult:
    """Bring ``body``'s children and status in line with its spec.

    Args:
        children: the children as the watch cache and the operator's own writes show them;
            writes go through it.
        discovery: which optional APIs (PodMonitor) the cluster serves.
        body: the InferenceService as last seen (its status is compared against).
        settings: operator settings.
        observer: reads what the engine pods allocated (``status.observed``, ``SizingDrift``);
            None: not observed.
        adapter_loader: loads ``spec.adapters`` into the ready engine pods (``status.adapters``,
            ``AdaptersReady``); None: adapters are only loaded at pod start, once verified.
    Returns:
        the status patch to write (empty when nothing changed), Events for condition
        changes worth one (``transition_events``), the child writes that were made, and
        the API calls that failed.
    """
    meta = body.get("metadata") or {}
    owner = Owner(meta["name"], meta["namespace"], meta.get("uid"))
    generation = meta.get("generation")
    current = dict(body.get("status") or {})
    result = ReconcileResult()

    planning = None
    try:
        spec = parse_spec(body.get("spec") or {}, owner.name)
        check_spec(spec, owner.name, settings.policy, settings.engine_image)  # before anything is built
        planning = plan_input(spec, body, current.get("plan"))   # scaling alone keeps the plan
        outcome = plan_service(planning.spec_to_plan(spec))
    except SpecError as exc:  # a PolicyViolation names its own reason
        spec, outcome = None, PlanOutcome.rejected(getattr(exc, "reason", "InvalidSpec"), str(exc))
    # the sizing is there exactly when the plan is feasible (an invalid spec has none)
    sizing = outcome.sizing

    disaggregated = _disaggregated(children, owner, spec)
    desired: dict[str, Any] = {"observedGeneration": generation, "selector": owner.selector,
                               "endpoint": router_endpoint(owner) if disaggregated else endpoint(owner),
                               "plan": current.get("plan")}
    if sizing is not None:
        note = kept_plan_note(spec, sizing.replicas) if planning.kept else ""
        planned = Condition(c.PLANNED, "True", "Planned", outcome.message + note)
        await _apply_all(children, discovery, body, owner, spec, sizing, settings, desired, result,
                         verified_adapters(spec, current.get("adapters")), planning.planned_for)
    else:
        planned = Condition(c.PLANNED, "False", outcome.reason, outcome.message)
        desired["planError"] = _plan_error(outcome, generation)

    # what exists, whether or not this pass managed to write it
    pools = None
    if disaggregated:
        pools = pool_states(lambda name: children.get(DEPLOYMENT, owner.namespace, name), owner)
        state = combined(pools)
        desired["disaggregation"] = pools_status(pools)
    else:
        state = DeploymentState.read(_workload(children, owner, sizing))
    desired["replicas"] = state.replicas if state.exists else 0
    desired["readyReplicas"] = state.ready if state.exists else 0
    apply_error = "; ".join(str(f) for f in result.failures) or None
    pods = children.pods(owner.namespace, owner.name)
    scheduling = None
    if sizing is not None and state.exists and state.ready < state.desired:
        scheduling = scheduling_problem(pods, describe_placement(spec, sizing.gpu, settings))
    ready, *workload = workload_conditions(state, apply_error, scheduling, missing_message(result.missing_apis) or None)
    conditions = [planned, ready_condition(pools, ready) if pools is not None else ready, *workload]
    if spec is not None and (ignored := replicas_ignored(spec, current.get("conditions"))) is not None:
        conditions.append(ignored)
    if observer is not None:
        result.sizing = await _observe_engines(observer, owner, desired.get("plan"), pods, settings)
        desired["observed"] = result.sizing.observed
        desired["prefixCache"] = (await _observe_prefix_cache(observer, owner, desired.get("plan"), pods)
                                  or current.get("prefixCache"))
        conditions.append(result.sizing.condition)
    if adapter_loader is not None and spec is not None and spec.adapters:
        conditions.append(await _load_adapters(adapter_loader, owner, spec, desired, pods, result,
                                               verified_adapters(spec, current.get("adapters"))))
    elif spec is not None and spec.adapters:   # not loading this pass: keep what was seen
        desired["adapters"], desired["adaptersReady"] = current.get("adapters"), current.get("adaptersReady")
    result.figures = ServiceFigures(
        model_name=spec.model.served_name if spec is not None else None,
        replicas=state.replicas if state.exists else 0,
        desired_replicas=state.desired if state.exists else 0,
        max_replicas=(None if spec is None else most_pods(spec, sizing) if pools is not None and sizing is not None
                      else spec.autoscaling.ceiling if spec.autoscaling.enabled
                      else state.desired if state.exists else None),
        plan_outcome="feasible" if sizing is not None else "infeasible", plan_reason=planned.reason,
        sizing_drift=(result.sizing.condition.status == "True") if result.sizing is not None else None)
    desired["conditions"] = merge_conditions(current.get("conditions"), conditions, generation,
                                             now_rfc3339())
    result.status_patch = _status_patch(current, desired)
    result.events = transition_events(current.get("conditions"), conditions)
    return result


async def _apply_all(children: Children, discovery: Discovery, body: Mapping[str, Any], owner: Owner,
                     spec: InferenceServiceSpec, sizing: EngineSizing, settings: OperatorSettings,
                     desired: dict[str, Any], result: ReconcileResult,
                     verified: frozenset[str] = frozenset(), planned_for: Mapping[str, Any] | None = None) -> None:
    """Apply every desired child and remove the unwanted ones, recording failures;
    ``verified``: the adapters the engine loads at start-up; ``planned_for``: what the plan
    was made from (``status.plan.plannedFor``, ``scaling.PlanInput``)."""
    try:
        served = await served_apis(discovery)
    except KubeError as exc:
        result.failures.append(Failure("discovery of the optional APIs", exc))
        return
    result.missing_apis = missing_apis(spec, sizing, served)
    if any(m.blocking for m in result.missing_apis):
        return
    inherited = inherited_replicas(_workload(children, owner, sizing), spec.autoscaling.enabled)
    wanted = desired_children(owner, spec, sizing, settings, podmonitor_api=served[PROMETHEUS],
                              inherited_replicas=inherited, inference_pool_api=served[INFERENCE],
                              keda_api=served[KEDA], verified_adapters=verified)
    for child in wanted:
        # Owner reference + the CR's labels on the child (not on the pod template: a
        # label edit on the InferenceService must not restart GPU pods).
        kopf.adopt(child.body, owner=body)
        try:
            await apply_child(children, child, result)
        except KubeError as exc:  # reported through Degraded (and an Event when it starts)
            result.failures.append(Failure(f"{child.kind.kind} {child.name}", exc))
            logger.debug("applying %s failed: %s", child.kind.kind, exc)
            if exc.status == 429:  # the server asks us to slow down: no more writes this pass
                return
            continue
        if child.kind in WORKLOADS:
            desired["plan"] = {**sizing.status, "generation": desired["observedGeneration"],
                               **({"plannedFor": dict(planned_for)} if planned_for else {})}
    absent = {api.group for api, is_served in served.items() if not is_served}
    await _remove_unwanted(children, owner, {(ch.kind.kind, ch.name) for ch in wanted}, absent, result)


def _disaggregated(children: Children, owner: Owner, spec: InferenceServiceSpec | None) -> bool:
    """Whether the service runs as two pools: its spec says so, or (a spec that does not
    parse) its pools' Deployments are what exists."""
    if spec is not None:
        return spec.disaggregation is not None
    return any(children.get(DEPLOYMENT, owner.namespace, pool_name(owner, role)) is not None
               for role in ("prefill", "decode"))


def _workload(children: Children, owner: Owner, sizing: EngineSizing | None) -> Mapping[str, Any] | None:
    """The engine pods' owner as last seen: the plan's kind (a LeaderWorkerSet for replicas of
    several nodes, else the Deployment); without a plan whichever exists."""
    kinds = [workload_kind(sizing.nodes)] if sizing is not None else list(WORKLOADS)
    for kind in kinds:
        obj = children.get(kind, owner.namespace, workload_name(owner, kind))
        if obj is not None:
            return obj
    return None


async def _observe_engines(observer: EngineObserver, owner: Owner, plan: Mapping[str, Any] | None,
                           pods: Sequence[Mapping[str, Any]], settings: OperatorSettings) -> SizingObservation:
    """Planned vs observed KV capacity of the pods running ``plan`` (reads never fail the pass)."""
    serve_args = (plan or {}).get("serveArgs")
    running = engine_pods(pods, serve_args) if serve_args else []
    samples = await observer.observe((owner.namespace, owner.name), running)
    found = sizing_observation(plan, samples, settings.sizing_drift_threshold)
    return dataclasses.replace(found, unread=len(running) - len(samples))


async def _observe_prefix_cache(observer: EngineObserver, owner: Owner, plan: Mapping[str, Any] | None,
                                pods: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``status.prefixCache``: the window's hit rate, and the top miss reason when it dropped."""
    serve_args = (plan or {}).get("serveArgs")
    running = engine_pods(pods, serve_args) if serve_args else []
    return await observer.observe_prefix_cache((owner.namespace, owner.name), running, time.monotonic())


def verified_adapters(spec: InferenceServiceSpec, status: Any) -> frozenset[str]:
    """The adapters ``status.adapters`` shows seen to load for the source the spec still
    names (``verified``; Ready, from an operator that did not write it): the engine pods
    load them at start-up, before they are ready (``resources.adapters``)."""
    sources = {a.name: a.source for a in spec.adapters}
    return frozenset(e["name"] for e in status or () if isinstance(e, Mapping)
                     and sources.get(e.get("name")) == e.get("source")
                     and (e.get("phase") == READY or (e.get("verified") is True and e.get("phase") != FAILED)))


def adapter_entries(found: Sequence[AdapterStatus], sources: Mapping[str, str],
                    verified: frozenset[str]) -> list[dict]:
    """``status.adapters`` of this pass; ``verified``: the adapters seen to load before it.

    NOTE: an adapter stays verified while no ready pod serves it (Pending, Loading: a pod
    was killed, a new one is starting), so the pods started meanwhile still load it at
    start-up; it stops being so once Failed (or when its source changes).
    """
    return [{**s.to_dict(), "source": sources[s.name],
             "verified": s.phase == READY or (s.name in verified and s.phase != FAILED)} for s in found]


async def _load_adapters(loader: AdapterLoader, owner: Owner, spec: InferenceServiceSpec,
                         desired: dict[str, Any], pods: Sequence[Mapping[str, Any]],
                         result: ReconcileResult, verified: frozenset[str]) -> Condition:
    """Load the adapters into the ready engine pods; ``status.adapters`` and AdaptersReady
    (``verified``: the adapters seen to load before this pass)."""
    paths, sources = adapter_paths(spec), {a.name: a.source for a in spec.adapters}
    serve_args = (desired.get("plan") or {}).get("serveArgs")
    running = engine_pods(pods, serve_args) if serve_args else []
    found = await loader.sync((owner.namespace, owner.name),
                              [AdapterTarget(a.name, paths[a.name]) for a in spec.adapters], running)
    desired["adapters"] = adapter_entries(found, sources, verified)
    desired["adaptersReady"] = ready_total(found)
    result.adapters_settling = any(s.phase not in (READY, FAILED) for s in found)
    failed = [f"{s.name}: {s.reason}" for s in found if s.phase == FAILED]
    waiting = [s.name for s in found if s.phase not in (READY, FAILED)]
    if failed:
        return Condition(c.ADAPTERS_READY, "False", "AdapterFailed", "; ".join(failed)[:1024])
    if waiting:
        return Condition(c.ADAPTERS_READY, "False", "AdaptersLoading", f"not yet on every ready pod: {', '.join(waiting)}")
    return Condition(c.ADAPTERS_READY, "True", "AdaptersReady", f"{len(found)} adapter(s) on every ready pod")


def transition_events(current: Any, conditions: list[Condition]) -> list[Event]:
    """Events for a condition whose status or reason changed: Planned, Degraded (turning on,
    or to another reason, and Recovered when it turns off), AdaptersReady (but not while
    loading), ReplicasIgnored turning on and SizingDrift turning on or off.

    NOTE: the message alone never posts an Event. It carries what changes while the state
    does not (the Pending pod count, the scheduler's text, the numbers of a plan), so a
    service that stays unschedulable, infeasible or failing is reported once per reason,
    not on every change of its detail or every resync; ``kubectl describe`` shows the
    latest message in the condition.
    """
    old = {cd.get("type"): cd for cd in current or () if isinstance(cd, Mapping)}
    events = []
    for cond in conditions:
        before = old.get(cond.type) or {}
        changed = (before.get("status"), before.get("reason")) != (cond.status, cond.reason)
        if cond.type == c.PLANNED and changed:
            events.append(Event("Normal" if cond.status == "True" else "Warning", cond.reason, cond.message))
        elif cond.type == c.DEGRADED and changed and cond.status == "True":
            events.append(Event("Warning", cond.reason, cond.message))
        elif cond.type == c.DEGRADED and before.get("status") == "True" and cond.status == "False":
            events.append(Event("Normal", "Recovered", "no longer degraded"))
        elif cond.type == c.ADAPTERS_READY and changed and cond.reason != "AdaptersLoading":
            events.append(Event("Warning" if cond.status == "False" else "Normal", cond.reason, cond.message))
        elif cond.type == c.REPLICAS_IGNORED and changed and cond.status == "True":
            events.append(Event("Warning", cond.reason, cond.message))
        elif cond.type == c.SIZING_DRIFT and before.get("status") != cond.status:
            if cond.status == "True":
                events.append(Event("Warning", "SizingDrift", cond.message))
            elif before.get("status") == "True":
                events.append(Event("Normal", "SizingAsPlanned", cond.message))
    return events
