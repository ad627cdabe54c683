"""The HorizontalPodAutoscaler's replica calculation, as the Kubernetes controller does it
(pkg/controller/podautoscaler/replica_calculator.go), for the metric types kvpilot uses.

- ``Pods`` metric, ``AverageValue`` target (the operator's HPA, through the adapter):
  ratio = mean of the pods' values / target; within the tolerance (10 %) of 1 the count
  stays, else it becomes ceil(ratio x pods with a value).
- ``External`` metric, ``AverageValue`` target (what KEDA's HPA does with a Prometheus
  trigger's one number): ratio = value / (target x current replicas); within the
  tolerance the count stays, else it becomes ceil(value / target).
- Several metrics: the largest proposal wins; then the count is clamped to [min, max].

Left out (not needed to decide up or down here): unready and missing pods, and the
``behavior`` stabilization windows and rate policies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

TOLERANCE = 0.1  # the controller's --horizontal-pod-autoscaler-tolerance default


def pods_proposal(current: int, values: Mapping[str, float], target: float) -> int:
    """Replicas one ``Pods`` metric asks for, from the per-pod ``values`` (pod -> value)."""
    if not values:
        return current  # no data: the controller leaves the count
    ratio = sum(values.values()) / len(values) / target
    if abs(1.0 - ratio) <= TOLERANCE:
        return current
    return math.ceil(ratio * len(values))


def external_average_proposal(current: int, value: float, target: float) -> int:
    """Replicas one ``External`` ``AverageValue`` metric (a KEDA trigger) asks for."""
    if current > 0 and abs(1.0 - value / (target * current)) <= TOLERANCE:
        return current
    return math.ceil(value / target)


def desired_replicas(proposals: Iterable[int], min_replicas: int, max_replicas: int) -> int:
    """The largest proposal, clamped to the autoscaler's bounds."""
    return max(min_replicas, min(max_replicas, max(proposals)))
