"""What a change of the replica count does: scaling never re-plans a running service.

The planner sizes each replica for its share of the SLO (``slo.concurrency`` is across all
replicas; a pinned ``spec.replicas`` divides it), so a plan made for another count has other
engine flags (``--max-num-seqs``, ``--kv-cache-dtype``, ...), and new flags mean a new pod
template: every running pod replaced. ``kubectl scale kvis`` (the scale subresource) and an
edit of ``spec.replicas`` are asking for more or fewer copies of what runs, not for other
pods, so:

- **Scaling keeps the plan.** ``status.plan.plannedFor`` records what the running plan was
  made from: a digest of the spec without ``replicas`` (and of the ``serving.kvpilot.dev/replan``
  annotation) and the replica count the planner was given (none: its own choice). While the
  digest is unchanged, a new ``spec.replicas`` changes only the workload's replica count;
  the planner runs again with the recorded count, so the flags stay exactly as they are,
  and the Planned condition's message says the service was scaled without re-planning.
- **A re-plan** happens when anything else in the spec changes (it is planned for the
  replica count of that moment), or when the user asks: a new value of the annotation
  ``serving.kvpilot.dev/replan`` (``kubectl annotate kvis NAME
  serving.kvpilot.dev/replan="$(date +%s)" --overwrite``), which rolls the pods out on the
  plan for the current count.
- **An autoscaler owns the count.** With ``autoscaling.mode`` hpa or keda the planner never
  sees ``spec.replicas`` and the Deployment's count is the autoscaler's; the API server still
  accepts ``kubectl scale kvis``, so ``ReplicasIgnored=True`` says that the value is ignored
  and what decides instead (a Warning Event when it turns on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.spec import InferenceServiceSpec
from kvpilot.operator.status import Condition


def planning_replicas(spec: InferenceServiceSpec) -> int | None:
    """The replica count the planner is given for ``spec``: ``spec.replicas`` while no
    autoscaler owns the count (0, scaled to zero, is not a size to plan for), else None
    (the planner's own choice)."""
    return spec.replicas if spec.replicas and not spec.autoscaling.enabled else None


def spec_digest(body: Mapping[str, Any]) -> str:
    """A digest of what a plan is made from: the spec without ``replicas``, and the
    ``serving.kvpilot.dev/replan`` annotation (changing it asks for a re-plan)."""
    spec = {k: v for k, v in (body.get("spec") or {}).items() if k != "replicas"}
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    text = json.dumps({"spec": spec, "replan": annotations.get(c.ANNOTATION_REPLAN)},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class PlanInput:
    """What to plan ``spec`` for this pass.

    Args:
        digest: ``spec_digest`` of the object.
        replicas: the replica count the planner is given (None: its own choice).
        kept: the count is the running plan's, not the spec's (scaled without re-planning).
    """

    digest: str
    replicas: int | None
    kept: bool = False

    @property
    def planned_for(self) -> dict:
        """``status.plan.plannedFor``."""
        return {"specDigest": self.digest, **({"replicas": self.replicas} if self.replicas else {})}

    def spec_to_plan(self, spec: InferenceServiceSpec) -> InferenceServiceSpec:
        """``spec`` as the planner should see it (``replicas`` = the count planned for)."""
        return dataclasses.replace(spec, replicas=self.replicas) if self.kept else spec


def plan_input(spec: InferenceServiceSpec, body: Mapping[str, Any], applied: Mapping[str, Any] | None) -> PlanInput:
    """Plan for the spec's replica count, unless only ``spec.replicas`` changed since the
    running plan (``applied``, ``status.plan``) was made: then for the count it was made for."""
    digest, wanted = spec_digest(body), planning_replicas(spec)
    planned_for = (applied or {}).get("plannedFor") or {}
    if planned_for.get("specDigest") == digest and planned_for.get("replicas") != wanted:
        return PlanInput(digest, planned_for.get("replicas"), kept=True)
    return PlanInput(digest, wanted)


def kept_plan_note(spec: InferenceServiceSpec, plan_replicas: int) -> str:
    """The Planned message's note for a service scaled without re-planning."""
    count = spec.replicas if spec.replicas is not None else plan_replicas
    return (f" Scaled to {count} replica(s) without re-planning: the pods keep the flags planned for "
            f"{plan_replicas} replica(s); annotate {c.ANNOTATION_REPLAN}=<new value> to re-plan.")


def replicas_ignored(spec: InferenceServiceSpec, current: Any) -> Condition | None:
    """``ReplicasIgnored``: True while ``spec.replicas`` is set and an autoscaler owns the
    count; False once it is not (only for a service that has the condition, or autoscales)."""
    had = any(isinstance(cd, Mapping) and cd.get("type") == c.REPLICAS_IGNORED for cd in current or ())
    auto = spec.autoscaling
    if auto.enabled and spec.replicas is not None:
        kind = "HorizontalPodAutoscaler" if auto.mode == "hpa" else "KEDA ScaledObject"
        return Condition(c.REPLICAS_IGNORED, "True", "AutoscalerOwnsReplicas", (
            f"spec.replicas {spec.replicas} (kubectl scale kvis) is ignored while autoscaling.mode is {auto.mode}: "
            f"the {kind} sets the count between autoscaling.minReplicas {auto.min_replicas} and maxReplicas "
            f"{auto.ceiling}; change those, or set autoscaling.mode: none to scale by hand"))
    if auto.enabled or had:
        return Condition(c.REPLICAS_IGNORED, "False", "ReplicasUnset" if auto.enabled else "NotAutoscaled",
                         "spec.replicas is unset; the autoscaler sets the count" if auto.enabled
                         else "no autoscaler: spec.replicas sets the count")
    return None
