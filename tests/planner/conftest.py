"""Shared helpers for the planner tests: build requests from a few keyword arguments."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.planner import PlanRequest, make_plan


def request_dict(model: Any = "qwen3-8b", gpu: Any = "h100-80gb", overrides: dict | None = None,
                 **slo: Any) -> dict[str, Any]:
    """A request dict; SLO fields default to a 32k-context chat workload."""
    base = {"max_context": 32768, "p95_prompt_tokens": 4096, "p95_output_tokens": 1024}
    return {"model": model, "gpu": gpu, "slo": {**base, **slo}, "overrides": overrides or {}}


@pytest.fixture
def plan_for():
    """plan_for(model=..., gpu=..., overrides={...}, **slo) -> Plan."""

    def build(**kwargs: Any):
        return make_plan(PlanRequest.from_dict(request_dict(**kwargs)))

    return build


@pytest.fixture
def req_dict():
    """req_dict(model=..., gpu=..., overrides={...}, **slo) -> request dict."""
    return request_dict
