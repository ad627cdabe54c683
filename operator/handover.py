"""Who owns the engine Deployment's replica count, and the hand-over between owners.

While an autoscaler (HPA or KEDA ScaledObject) exists it owns ``spec.replicas``: the
operator sets the count when it creates the Deployment and never writes it again
(``Child.create_only``). Switching ``spec.autoscaling.mode`` hands the count over, and
neither direction may shrink the service:

- **none -> hpa/keda.** The operator stops managing ``spec.replicas``. Its last-applied
  annotation still lists the field, and a field that was applied before and is no longer
  managed is normally removed (set to null) by the next patch; for ``spec.replicas`` the
  API server would then default it to 1 and the service would drop to one pod until the
  autoscaler reacts. A create-only field changes hands instead: ``reconcile.apply_child``
  never removes it.
- **hpa/keda -> none.** The operator takes the count back. With ``spec.replicas`` unset
  it would apply the planner's count, which may be far below what the autoscaler had
  reached under load. Instead it inherits the autoscaler's last count: it keeps at least
  that many replicas (remembered in the Deployment's ``inherited-replicas`` annotation)
  until ``spec.replicas`` is set (``kubectl scale kvis NAME --replicas N``) or autoscaling
  comes back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvpilot.operator import constants as c


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _count(value: Any) -> int | None:
    try:
        count = int(value)
    except (TypeError, ValueError):
        return None
    return count if count >= 0 else None


def inherited_replicas(deployment: Mapping[str, Any] | None, autoscaled: bool) -> int | None:
    """The replica count the operator inherits from an autoscaler, or None.

    Args:
        deployment: the engine Deployment as stored (None: not created yet).
        autoscaled: whether the spec asks for an autoscaler now (then nothing is inherited).
    Returns:
        the count remembered from an earlier hand-over, else the Deployment's current count
        when its last-applied annotation shows that an autoscaler held it (the operator
        applied no ``spec.replicas``), else None.
    """
    if deployment is None or autoscaled:
        return None
    annotations = _annotations(deployment)
    remembered = _count(annotations.get(c.ANNOTATION_INHERITED_REPLICAS))
    if remembered is not None:
        return remembered
    try:
        applied = json.loads(annotations.get(c.ANNOTATION_LAST_APPLIED) or "null")
    except ValueError:
        return None
    if not isinstance(applied, Mapping) or not isinstance(applied.get("spec"), Mapping):
        return None  # never applied by this operator: nothing to hand over
    if "replicas" in applied["spec"]:
        return None  # the operator owned the count already
    return _count((deployment.get("spec") or {}).get("replicas", 1))
