"""Who owns the engine Deployment's replica count, and the hand-over between owners.

While an autoscaler (HPA or KEDA ScaledObject) exists it owns ``spec.replicas``: the
operator sets the count when it creates the Deployment and never sets it again
(``Child.create_only``). Switching ``spec.autoscaling.mode`` hands the count over, and
neither direction may shrink the service:

- **none -> hpa/keda.** The operator stops managing ``spec.replicas``. A field a server-side
  apply stops naming is removed when no other manager owns it, and the API server would
  then default the count to 1, dropping the service to one pod until the autoscaler
  reacts. A create-only field changes hands instead: the operator keeps applying its live
  value for as long as it owns it (``server_side_apply.applied_config``), and stops once
  the autoscaler has scaled (which makes the autoscaler its owner).
- **hpa/keda -> none.** The operator takes the count back. With ``spec.replicas`` unset
  it would apply the planner's count, which may be far below what the autoscaler had
  reached under load. Instead it inherits the autoscaler's last count: it keeps at least
  that many replicas (remembered in the Deployment's ``inherited-replicas`` annotation)
  until ``spec.replicas`` is set (``kubectl scale kvis NAME --replicas N``) or autoscaling
  comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.server_side_apply import owned_paths, owns


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
        when the operator has applied the Deployment but no longer owns its count (an
        autoscaler scaled it), else None.
    """
    if deployment is None or autoscaled:
        return None
    annotations = (deployment.get("metadata") or {}).get("annotations") or {}
    remembered = _count(annotations.get(c.ANNOTATION_INHERITED_REPLICAS))
    if remembered is not None:
        return remembered
    if owned_paths(deployment) is None:
        return None  # never applied by this operator: nothing to hand over
    if owns(deployment, "spec.replicas"):
        return None  # the operator owns the count (still, or again)
    return _count((deployment.get("spec") or {}).get("replicas", 1))
