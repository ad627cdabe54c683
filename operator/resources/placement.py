"""Where engine pods may run: on nodes with the GPU type the plan was made for.

The plan (KV cache bytes, batch sizes) is exact for one GPU type, so the pod must not land
on another. By default the pod requires the node label ``settings.gpu_node_label``
(GPU feature discovery's ``nvidia.com/gpu.product``) to be one of the planned type's
product names (``settings.gpu_node_values_for``, from the GPU catalogue). Overrides:

- ``spec.gpu.nodeSelector``: the user's own way to find that GPU (a cloud's accelerator
  label, say); it replaces the default match and joins the pod's ``nodeSelector``;
- ``spec.affinity``: passed through; the GPU match is added to each of its required node
  terms (Kubernetes ORs the terms, so each term must carry it);
- ``spec.nodeSelector`` / ``spec.tolerations``: added as given (the GPU taint is tolerated).
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec

GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def gpu_node_requirement(gpu: str | None, settings: OperatorSettings) -> dict | None:
    """The node-selector requirement that means "a ``gpu`` node", or None when placement is off."""
    if gpu is None or settings.gpu_node_label is None:
        return None
    return {"key": settings.gpu_node_label, "operator": "In",
            "values": list(settings.gpu_node_values_for(gpu))}


def node_selector(spec: InferenceServiceSpec) -> dict[str, str]:
    """The pod's ``nodeSelector``: ``spec.nodeSelector`` plus ``spec.gpu.nodeSelector``."""
    return {**spec.node_selector, **(spec.gpu.node_selector or {})}


def affinity(spec: InferenceServiceSpec, gpu: str | None, settings: OperatorSettings) -> dict[str, Any]:
    """The pod's ``affinity``: ``spec.affinity`` with the GPU match required on every node term.

    Args:
        spec: the parsed spec (``gpu.nodeSelector`` set = the user's match replaces ours).
        gpu: the planned catalogue GPU type.
        settings: the label key and the values per GPU type.
    """
    result = copy.deepcopy(dict(spec.affinity))
    requirement = None if spec.gpu.node_selector is not None else gpu_node_requirement(gpu, settings)
    if requirement is None:
        return result
    node = result.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*(term.get("matchExpressions") or []), requirement]}
        for term in terms]
    return result


def tolerations(spec: InferenceServiceSpec) -> list[dict]:
    """GPU nodes are commonly tainted ``nvidia.com/gpu:NoSchedule``; plus ``spec.tolerations``."""
    return [dict(GPU_TOLERATION), *(dict(t) for t in spec.tolerations)]


def describe(spec: InferenceServiceSpec, gpu: str | None, settings: OperatorSettings) -> str:
    """The node requirements in words, for status messages: ``nvidia.com/gpu.product in (NVIDIA-L4)``."""
    parts = [f"{k}={v}" for k, v in node_selector(spec).items()]
    requirement = None if spec.gpu.node_selector is not None else gpu_node_requirement(gpu, settings)
    if requirement is not None:
        parts.append(f"{requirement['key']} in ({', '.join(requirement['values'])})")
    return ", ".join(parts)
