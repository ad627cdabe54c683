"""Autoscalers on the engine's own load signals: a composite of three per-pod targets.

KV cache usage alone misses saturation under prefill-heavy load (the queue grows while
usage stays flat), so every autoscaler watches three signals and follows whichever asks
for the most replicas (the HPA's rule for several metrics):

| signal                 | engine series                 | HPA custom metric (adapter rename)  |
|------------------------|-------------------------------|-------------------------------------|
| KV cache usage (0..1)  | ``vllm:kv_cache_usage_perc``  | ``vllm_kv_cache_usage_perc``        |
| queued requests        | ``vllm:num_requests_waiting`` | ``vllm_num_requests_waiting``       |
| preemptions per second | ``vllm:num_preemptions_total``| ``vllm_num_preemptions_per_second`` |

- HPA (``autoscaling/v2``): ``Pods`` metrics served by a Prometheus adapter whose rules
  ship with the chart (``charts/kvpilot/files/prometheus-adapter/``); the names are
  operator settings.
- KEDA (``keda.sh/v1alpha1`` ScaledObject): PromQL over the engine's own series,
  filtered by ``namespace`` (added by the scrape) and ``model_name`` (the engine's label:
  the first served name), summed over the pods with ``AverageValue`` so that each target
  is per pod, as with the HPA. ``minReplicas: 0`` (scale to zero) is KEDA's alone.

Both target the Deployment; while one exists the operator leaves ``spec.replicas`` alone.
"""

from __future__ import annotations

from kvpilot.operator.resources.common import LWS_API_VERSION, Owner, decimal_quantity
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import AutoscalingSpec, InferenceServiceSpec

KEDA_API = ("keda.sh", "v1alpha1")
KV_USAGE_SERIES = "vllm:kv_cache_usage_perc"
TTFT_SERIES = "vllm:time_to_first_token_seconds"   # a histogram (_bucket, _sum, _count)
WAITING_SERIES = "vllm:num_requests_waiting"
PREEMPTIONS_SERIES = "vllm:num_preemptions_total"
# The window of the preemption rate (here and in the adapter rule): long enough to hold a
# few scrapes at the usual 15-30 s interval, short enough to let go soon after a burst.
RATE_WINDOW = "1m"
# Scale up soon but not on one spike (a new pod needs minutes to load its weights anyway):
# the highest recommendation of the last 30 s, at most doubling or +2 pods a minute.
SCALE_UP_BEHAVIOR = {
    "stabilizationWindowSeconds": 30,
    "selectPolicy": "Max",
    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60},
                 {"type": "Pods", "value": 2, "periodSeconds": 60}],
}
# Scaling down drops a pod's prefix cache and a new pod needs minutes to load weights:
# shrink slowly, one pod at a time.
SCALE_DOWN_BEHAVIOR = {
    "stabilizationWindowSeconds": 300,
    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
}
BEHAVIOR = {"scaleUp": SCALE_UP_BEHAVIOR, "scaleDown": SCALE_DOWN_BEHAVIOR}


def workload_ref(owner: Owner, nodes: int = 1) -> dict:
    """The object whose replicas are the service's: its Deployment, or with replicas of
    several nodes its LeaderWorkerSet (whose scale subresource counts groups)."""
    if nodes > 1:
        return {"apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet", "name": owner.group_name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name}


def pods_metric(name: str, per_pod: float) -> dict:
    """An HPA ``Pods`` metric whose per-pod average should stay at ``per_pod``."""
    return {"type": "Pods", "pods": {
        "metric": {"name": name},
        "target": {"type": "AverageValue", "averageValue": decimal_quantity(per_pod)},
    }}


def hpa(metadata: dict, target: dict, auto: AutoscalingSpec, metrics: list[dict]) -> dict:
    """An autoscaling/v2 HPA of ``target`` between ``auto``'s bounds on ``metrics``."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": target,
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.ceiling,
            "metrics": metrics,
            "behavior": BEHAVIOR,
        },
    }


def build_hpa(owner: Owner, spec: InferenceServiceSpec, settings: OperatorSettings, nodes: int = 1) -> dict:
    """An autoscaling/v2 HPA on the three per-pod signals (KV usage, queue, preemptions)."""
    auto = spec.autoscaling
    metrics = [pods_metric(settings.hpa_kv_usage_metric, auto.kv_cache_usage_target),
               pods_metric(settings.hpa_waiting_metric, auto.waiting_requests_target),
               pods_metric(settings.hpa_preemption_metric, auto.preemption_rate_target)]
    return hpa(owner.metadata("autoscaler"), workload_ref(owner, nodes), auto, metrics)


def keda_queries(owner: Owner, spec: InferenceServiceSpec) -> list[tuple[str, float]]:
    """(PromQL, per-pod threshold) of each KEDA trigger: sums over the service's pods."""
    match = f'{{namespace="{owner.namespace}",model_name="{spec.model.served_name}"}}'
    auto = spec.autoscaling
    return [(f"sum({KV_USAGE_SERIES}{match})", auto.kv_cache_usage_target),
            (f"sum({WAITING_SERIES}{match})", auto.waiting_requests_target),
            (f"sum(rate({PREEMPTIONS_SERIES}{match}[{RATE_WINDOW}]))", auto.preemption_rate_target)]


def prometheus_trigger(auto: AutoscalingSpec, query: str, threshold: float, metric_type: str = "AverageValue") -> dict:
    """A KEDA Prometheus trigger: ``AverageValue`` divides the query's value by the replicas
    (a per-pod target), ``Value`` compares it as it is (a latency quantile)."""
    return {"type": "prometheus", "metricType": metric_type,
            "metadata": {"serverAddress": auto.prometheus_server_address, "query": query,
                         "threshold": f"{threshold:g}"}}


def build_scaledobject(owner: Owner, spec: InferenceServiceSpec, nodes: int = 1) -> dict:
    """A KEDA ScaledObject with Prometheus triggers on the engine's vLLM-named series."""
    auto = spec.autoscaling
    triggers = [prometheus_trigger(auto, query, threshold) for query, threshold in keda_queries(owner, spec)]
    return scaled_object(owner.metadata("autoscaler"), workload_ref(owner, nodes), auto, triggers)


def scaled_object(metadata: dict, target: dict, auto: AutoscalingSpec, triggers: list[dict]) -> dict:
    """A KEDA ScaledObject of ``target`` between ``auto``'s bounds on ``triggers``."""
    return {
        "apiVersion": "/".join(KEDA_API),
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": target,
            "minReplicaCount": auto.min_replicas,   # 0 = scale to zero when every trigger is idle
            "maxReplicaCount": auto.ceiling,
            "pollingInterval": 15,
            "cooldownPeriod": 300,                  # idle time before the last replica goes (0 only)
            "triggers": triggers,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": BEHAVIOR}},
        },
    }
