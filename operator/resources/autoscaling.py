"""Autoscalers on the engine's own load signals: KV cache usage and queued requests.

Both target the Deployment (not the InferenceService's scale subresource), and while one
exists the operator leaves ``Deployment.spec.replicas`` alone. Metric names:

- HPA (``autoscaling/v2``, Pods metrics through a Prometheus adapter): the custom-metrics
  names from the operator settings, by default ``vllm_kv_cache_usage_perc`` and
  ``vllm_num_requests_waiting`` (the adapter renames the engine's ``vllm:`` series).
- KEDA (``keda.sh/v1alpha1`` ScaledObject): PromQL over the engine's own series
  ``vllm:kv_cache_usage_perc`` / ``vllm:num_requests_waiting``, summed over the service's
  pods with ``AverageValue`` so the target is per pod, as with the HPA.
"""

from __future__ import annotations

from kvpilot.operator.resources.common import Owner, decimal_quantity
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec

KEDA_API = ("keda.sh", "v1alpha1")
# Scaling down drops a pod's prefix cache and a new pod needs minutes to load weights:
# shrink slowly, one pod at a time.
SCALE_DOWN_BEHAVIOR = {
    "stabilizationWindowSeconds": 300,
    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
}


def _target(owner: Owner) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name}


def _pods_metric(name: str, per_pod: float) -> dict:
    """An HPA ``Pods`` metric whose per-pod average should stay at ``per_pod``."""
    return {"type": "Pods", "pods": {
        "metric": {"name": name},
        "target": {"type": "AverageValue", "averageValue": decimal_quantity(per_pod)},
    }}


def build_hpa(owner: Owner, spec: InferenceServiceSpec, settings: OperatorSettings) -> dict:
    """An autoscaling/v2 HPA averaging KV usage (and optionally queue length) per pod."""
    auto = spec.autoscaling
    metrics = [_pods_metric(settings.hpa_kv_usage_metric, auto.kv_cache_usage_target)]
    if auto.waiting_requests_target is not None:
        metrics.append(_pods_metric(settings.hpa_waiting_metric, auto.waiting_requests_target))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": owner.metadata("autoscaler"),
        "spec": {
            "scaleTargetRef": _target(owner),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.ceiling,
            "metrics": metrics,
            "behavior": {"scaleDown": SCALE_DOWN_BEHAVIOR},
        },
    }


def _trigger(owner: Owner, spec: InferenceServiceSpec, metric: str, threshold: str) -> dict:
    """A KEDA Prometheus trigger on the sum of ``metric`` over the service's pods."""
    query = f'sum({metric}{{namespace="{owner.namespace}",model_name="{spec.model.served_name}"}})'
    return {"type": "prometheus", "metricType": "AverageValue",
            "metadata": {"serverAddress": spec.autoscaling.prometheus_server_address,
                         "query": query, "threshold": threshold}}


def build_scaledobject(owner: Owner, spec: InferenceServiceSpec) -> dict:
    """A KEDA ScaledObject with Prometheus triggers on the engine's vLLM-named series."""
    auto = spec.autoscaling
    triggers = [_trigger(owner, spec, "vllm:kv_cache_usage_perc", f"{auto.kv_cache_usage_target:g}")]
    if auto.waiting_requests_target is not None:
        triggers.append(_trigger(owner, spec, "vllm:num_requests_waiting", str(auto.waiting_requests_target)))
    return {
        "apiVersion": "/".join(KEDA_API),
        "kind": "ScaledObject",
        "metadata": owner.metadata("autoscaler"),
        "spec": {
            "scaleTargetRef": _target(owner),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.ceiling,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "triggers": triggers,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": SCALE_DOWN_BEHAVIOR}}},
        },
    }
