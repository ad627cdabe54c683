"""The InferencePool of an InferenceService: Gateway API inference routing to its pods.

When the cluster serves ``inference.networking.k8s.io/v1`` (the Gateway API inference
extension), each service gets an InferencePool of the same name, owned by it:

- ``selector.matchLabels``: the engine pods' labels (the Service's selector);
- ``targetPorts``: the engine port (``spec.port``);
- ``endpointPickerRef``: the endpoint picker (EPP) Service that routes each request to a
  pod by its load and prefix-cache state: ``spec.routing.inferencePool.endpointPickerRef``,
  else the operator's ``KVPILOT_EPP_NAME`` / ``_PORT`` / ``_FAILURE_MODE``.

The endpoint picker reads each pod's engine type from the ``inference.networking.k8s.io/
engine-type`` label and scrapes the metrics of that engine: the pods say ``vllm``, whose
metric names the engine exports (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info`` with ``block_size`` and
``num_gpu_blocks``).
"""

from __future__ import annotations

from kvpilot.operator.resources.common import Owner
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec

INFERENCE_POOL_API = ("inference.networking.k8s.io", "v1")
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "vllm"  # the metric names the engine exports are vLLM's


def build_inference_pool(owner: Owner, spec: InferenceServiceSpec, settings: OperatorSettings) -> dict:
    """An ``inference.networking.k8s.io/v1`` InferencePool over ``owner``'s engine pods."""
    pool = spec.inference_pool
    return {
        "apiVersion": "/".join(INFERENCE_POOL_API),
        "kind": "InferencePool",
        "metadata": owner.metadata("inference-pool"),
        "spec": {
            "selector": {"matchLabels": owner.selector_labels},
            "targetPorts": [{"number": spec.port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": pool.endpoint_picker or settings.endpoint_picker_for(owner.name),
                "port": {"number": pool.endpoint_picker_port or settings.endpoint_picker_port},
                "failureMode": pool.failure_mode or settings.endpoint_picker_failure_mode,
            },
        },
    }
