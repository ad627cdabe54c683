"""The InferenceService CustomResourceDefinition, rendered from the contract's tables.

``crds/serving.kvpilot.dev_inferenceservices.yaml`` is this document (``render``);
``scripts/sync_chart_crds.py`` writes it and its chart copy, and ``--check`` fails when
either differs from what the tables say.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.contract.inference_service import SPEC
from kvpilot.operator.contract.inference_service_status import STATUS
from kvpilot.operator.contract.schema import Obj

FILE_NAME = f"{c.GROUP}_{c.PLURAL}.yaml"
HEADER = """\
# InferenceService: one LLM served by kvpilot, sized by the planner from its SLOs.
# Reconciled by `kvpilot operator` into a Deployment, Service and (as needed) a model cache
# claim, a PVC for the disk KV tier, an HPA or KEDA ScaledObject, a PodMonitor, a
# PodDisruptionBudget and an InferencePool; with spec.disaggregation a prefill and a decode
# Deployment behind vLLM's router in P/D mode.
# GENERATED from kvpilot/operator/contract/ by scripts/sync_chart_crds.py: edit the tables there.
"""

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
    {"name": "GPU", "type": "string", "jsonPath": ".spec.gpu.type"},
    {"name": "KV-Dtype", "type": "string", "jsonPath": ".status.plan.kvCacheDtype"},
    {"name": "Max-Seqs", "type": "integer", "jsonPath": ".status.plan.maxNumSeqs"},
    {"name": "Observed-KV-Tokens", "type": "integer",
     "description": "KV cache capacity in tokens that the engine pods report (the pod furthest from the plan).",
     "jsonPath": ".status.observed.tokenCapacity"},
    {"name": "P:D", "type": "string",
     "description": "spec.disaggregation: the prefill:decode replicas the planner asks for.",
     "jsonPath": ".status.plan.disaggregation.ratio"},
    {"name": "Ready-Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Adapters", "type": "string", "jsonPath": ".status.adaptersReady"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd(spec: Obj = SPEC, status: Obj = STATUS) -> dict[str, Any]:
    """The CRD document for the ``spec`` and ``status`` schemas."""
    root = {"type": "object",
            "description": "An LLM served by the kvpilot engine, sized by the kvpilot planner from its SLOs.",
            "required": ["spec"],
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "metadata": {"type": "object"}, "spec": spec.openapi(), "status": status.openapi()}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{c.PLURAL}.{c.GROUP}",
                     "labels": {"app.kubernetes.io/name": c.APP_NAME, "app.kubernetes.io/component": "crd"}},
        "spec": {
            "group": c.GROUP, "scope": "Namespaced",
            "names": {"kind": c.KIND, "listKind": f"{c.KIND}List", "plural": c.PLURAL,
                      "singular": c.KIND.lower(), "shortNames": ["kvis"], "categories": [c.APP_NAME]},
            "versions": [{
                "name": c.VERSION, "served": True, "storage": True,
                # `kubectl scale` and external autoscalers act on spec.replicas; the operator
                # copies it to the Deployment while spec.autoscaling.mode is "none".
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def render(spec: Obj = SPEC, status: Obj = STATUS) -> str:
    """The CRD file's text."""
    return HEADER + yaml.safe_dump(crd(spec, status), sort_keys=False, width=100, allow_unicode=True)
