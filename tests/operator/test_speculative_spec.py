"""``spec.engine.speculative``: checked by the contract (the CRD's rules), passed to the
engine as ``--speculative-config`` with vLLM's field names, and sized by the planner."""

from __future__ import annotations

import copy
import json

import pytest

from kvpilot.engine.server.args import make_serve_parser
from kvpilot.operator.contract.schema import SpecError
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_overrides, plan_service

BASE = {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "gpu": {"type": "l4"},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2000, "p95OutputTokens": 500, "concurrency": 8}}


def _spec(speculative: dict):
    spec = copy.deepcopy(BASE)
    spec["engine"] = {"speculative": speculative}
    return parse_spec(spec, "svc")


def test_the_config_reaches_the_engine_flag_with_vllms_names():
    spec = _spec({"method": "draft_model", "model": "/models/Qwen/Qwen3-0.6B", "numSpeculativeTokens": 3,
                  "disableByBatchSize": 8})
    assert plan_overrides(spec).speculative == {"method": "draft_model", "model": "/models/Qwen/Qwen3-0.6B",
                                                "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    outcome = plan_service(spec)
    assert outcome.reason == "Planned", outcome.message
    args = list(outcome.sizing.serve_args)
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config["num_speculative_tokens"] == 3 and config["model"] == "/models/Qwen/Qwen3-0.6B"
    # the engine's own parser takes the flag as the operator writes it
    parsed = make_serve_parser().parse_args(["--speculative-config", json.dumps(config)])
    assert parsed.speculative_config.method == "draft_model"


@pytest.mark.parametrize(("speculative", "needle"), [
    ({"method": "ngram", "numSpeculativeTokens": 2, "model": "/m"}, "takes no model"),
    ({"method": "eagle", "numSpeculativeTokens": 2}, "model is required"),
    ({"method": "medusa", "numSpeculativeTokens": 2}, "method"),
    ({"method": "ngram"}, "numSpeculativeTokens is required"),
    ({"method": "ngram", "numSpeculativeTokens": 2, "draftTensorParallelSize": 2}, "draftTensorParallelSize"),
])
def test_bad_configs_are_refused_by_the_contract(speculative, needle):
    with pytest.raises(SpecError, match=needle):
        _spec(speculative)


def test_a_draft_the_planner_cannot_size_is_an_invalid_spec():
    outcome = plan_service(_spec({"method": "draft_model", "model": "/models/my-draft", "numSpeculativeTokens": 2}))
    assert outcome.reason == "InvalidSpec" and "catalogue preset" in outcome.message
