"""The HPA algorithm the closed-loop test decides with, against the worked examples of the
Kubernetes documentation ("Horizontal Pod Autoscaling", algorithm details):
desiredReplicas = ceil[currentReplicas x (currentMetricValue / desiredMetricValue)],
no change within the 0.1 tolerance, the largest proposal of several metrics, then min/max."""

from __future__ import annotations

from support.hpa_algorithm import desired_replicas, external_average_proposal, pods_proposal


def test_the_documented_ratios():
    four = {f"p{i}": 0.2 for i in range(4)}
    assert pods_proposal(4, four, 0.1) == 8                                 # 200m / 100m: doubled
    assert pods_proposal(4, {k: 0.05 for k in four}, 0.1) == 2              # 50m / 100m: halved
    assert pods_proposal(4, {k: 0.108 for k in four}, 0.1) == 4             # within 10 %: no change
    assert pods_proposal(4, {k: 0.111 for k in four}, 0.1) == 5             # just outside: ceil(4.44)
    assert pods_proposal(1, {"p": 0.9}, 0.7) == 2 and pods_proposal(1, {"p": 0.0}, 0.7) == 0
    assert pods_proposal(3, {}, 0.7) == 3                                   # no data: left alone


def test_the_average_is_over_the_pods():
    assert pods_proposal(2, {"a": 1.0, "b": 0.0}, 0.7) == 2                 # mean 0.5: ceil(1.43)
    assert pods_proposal(2, {"a": 1.0, "b": 0.6}, 0.7) == 3                 # mean 0.8: ceil(2.29)


def test_kedas_external_average_value():
    assert external_average_proposal(2, 20, 5) == 4                         # 20 queued / 5 per pod
    assert external_average_proposal(2, 10.5, 5) == 2                       # ratio 1.05: no change
    assert external_average_proposal(0, 0, 5) == 0


def test_several_metrics_and_the_bounds():
    assert desired_replicas([1, 3, 2], 1, 6) == 3
    assert desired_replicas([0, 0, 0], 1, 6) == 1
    assert desired_replicas([9], 1, 6) == 6
