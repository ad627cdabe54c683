"""The children the operator builds for one spec, as the reconcile pass stamps them
(shared by the builder tests of placement, the model cache and the InferencePool)."""

from __future__ import annotations

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.resources import Child, desired_children
from kvpilot.operator.resources.common import Owner
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_service

SETTINGS = OperatorSettings(engine_image="registry.example/kvpilot:1.2.3")
SMALL = {"model": {"uri": "hf://Qwen/Qwen3-0.6B"}, "gpu": {"type": "l4"},
         "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "concurrency": 8}}


def build(spec: dict, settings: OperatorSettings = SETTINGS, name: str = "svc", *,
          podmonitor_api: bool = False, inference_pool_api: bool = False) -> list[Child]:
    """``desired_children`` of a feasible ``spec`` in namespace ``serving``, owner-stamped by kopf."""
    cr = {"apiVersion": c.API_VERSION, "kind": c.KIND,
          "metadata": {"name": name, "namespace": "serving", "uid": "uid-1"}, "spec": spec}
    parsed = parse_spec(spec, name)
    outcome = plan_service(parsed)
    assert outcome.feasible, outcome.message
    children = desired_children(Owner(name, "serving", "uid-1"), parsed, outcome.sizing, settings,
                                podmonitor_api=podmonitor_api, inference_pool_api=inference_pool_api)
    for child in children:
        kopf.adopt(child.body, owner=cr)
    return children
