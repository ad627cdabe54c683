"""schemathesis fuzzes every operation of /openapi.json: no input may cause a 5xx.

Examples are bounded (``max_examples`` per operation) and generation lengths are
clamped so that a fuzzed request never asks the CPU for thousands of tokens.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
MAX_GENERATED_TOKENS = 3


def _bound_generation(body) -> None:
    """Keeps a fuzzed generation request short; invalid values are left for the server."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and value > MAX_GENERATED_TOKENS:
            body[key] = MAX_GENERATED_TOKENS
    # absent and null both mean "up to the context length" (minutes on a busy CPU)
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_GENERATED_TOKENS
    if "prompt" in body and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_GENERATED_TOKENS
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2
    if type(body.get("best_of")) is int and body["best_of"] > 2:
        body["best_of"] = 2


def test_no_server_errors(server, settings):
    # schemathesis' pytest plugin (from_fixture) breaks on pytest 9, so the operations'
    # strategies are driven by hypothesis directly.
    headers = {"Authorization": f"Bearer {settings.api_key}"}   # /openapi.json needs it too
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                               "GET /v1/models", "POST /tokenize", "GET /health"}
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if operation.body:
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                                 derandomize=True, suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                _bound_generation(case.body)
                case.call_and_validate(headers=headers, timeout=120,
                                       checks=[not_a_server_error, response_schema_conformance])

            run()
