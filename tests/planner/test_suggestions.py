"""Infeasible requests: a named binding constraint and suggestions that, applied, work."""

from __future__ import annotations

import json

import pytest

from kvpilot.operator.planner import PlanRequest, make_plan

# (scenario, request pieces, expected binding constraint, a suggestion kind that must be offered)
SCENARIOS = [
    ("32k context on an L4", dict(model="qwen3-8b", gpu="l4", max_context=32768, p95_prompt_tokens=8000,
                                  p95_output_tokens=1000, overrides={"tensor_parallel_size": 1}),
     "kv_capacity", {"fp8_kv", "max_context", "tensor_parallel", "gpu", "weight_quantization"}),
    ("70B weights on one A100", dict(model="llama-3.1-70b", gpu="a100-80gb", max_context=8192,
                                     p95_prompt_tokens=2048, p95_output_tokens=512,
                                     overrides={"tensor_parallel_size": 1}),
     "gpu_memory", {"tensor_parallel", "weight_quantization"}),
    ("ITL below the weight read time", dict(model="qwen3-32b", gpu="l4", max_context=8192, p95_prompt_tokens=2048,
                                            p95_output_tokens=512, itl_p95_ms=60,
                                            overrides={"tensor_parallel_size": 4}),
     "itl", {"tensor_parallel", "itl_target", "gpu"}),
    ("TTFT below the prefill time", dict(model="llama-3.1-8b", gpu="a10g", max_context=20000,
                                         p95_prompt_tokens=16384, p95_output_tokens=512, ttft_p95_ms=800,
                                         overrides={"tensor_parallel_size": 1}),
     "ttft", {"ttft_target", "gpu"}),
    ("pinned max_num_seqs too high", dict(model="qwen3-8b", gpu="h100-80gb", concurrency=500,
                                          overrides={"max_num_seqs": 500, "tensor_parallel_size": 1}),
     "kv_capacity", {"fewer_sequences", "fp8_kv"}),
    ("pinned replicas too few", dict(model="qwen3-8b", gpu="h100-80gb", concurrency=300,
                                     overrides={"replicas": 2, "tensor_parallel_size": 1}),
     "kv_capacity", {"replicas", "fewer_sequences", "drop_override"}),
    ("context beyond the model", dict(model="llama-2-7b", gpu="a100-80gb", max_context=16384,
                                      p95_prompt_tokens=2048, p95_output_tokens=512),
     "max_position_embeddings", {"max_context"}),
    ("two changes needed", dict(model="qwen3-32b", gpu="l4", max_context=131072, p95_prompt_tokens=4096,
                                p95_output_tokens=1024, overrides={"tensor_parallel_size": 1}),
     "max_position_embeddings", {"combined"}),
    ("pinned chunk over the ITL", dict(model="qwen3-8b", gpu="h100-80gb", itl_p95_ms=30,
                                       overrides={"max_num_batched_tokens": 16384}),
     "itl", {"drop_override"}),
]


@pytest.mark.parametrize("name, pieces, binding, kind", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_infeasible_plans_carry_working_suggestions(req_dict, name, pieces, binding, kind):
    request = PlanRequest.from_dict(req_dict(**pieces))
    plan = make_plan(request)
    assert not plan.feasible
    assert plan.binding_constraint == binding
    assert plan.binding_detail and any(not c.ok and c.name == binding for c in plan.checks)
    assert plan.suggestions, "an infeasible plan must offer at least one suggestion"
    assert kind & {s.kind for s in plan.suggestions}
    for suggestion in plan.suggestions:
        json.dumps(suggestion.apply)                        # machine-applicable plain data
        fixed = make_plan(request.apply(suggestion.apply))
        assert fixed.feasible, (suggestion.kind, suggestion.apply, fixed.binding_detail)


def test_suggestions_in_json_apply_through_from_dict(req_dict):
    """The operator's path: plan -> JSON -> patch its request dict -> plan again."""
    raw = req_dict(**SCENARIOS[0][1])
    plan = json.loads(json.dumps(make_plan(PlanRequest.from_dict(raw)).to_dict()))
    assert plan["feasible"] is False and plan["suggestions"]
    for suggestion in plan["suggestions"]:
        assert make_plan(PlanRequest.from_dict(raw).apply(suggestion["apply"])).feasible


def test_the_smallest_step_is_suggested(req_dict):
    request = PlanRequest.from_dict(req_dict(**SCENARIOS[1][1]))
    tp = [s for s in make_plan(request).suggestions if s.kind == "tensor_parallel"]
    assert [s.apply for s in tp] == [{"overrides": {"tensor_parallel_size": 2}}]
    shorter = [s for s in make_plan(PlanRequest.from_dict(req_dict(**SCENARIOS[0][1]))).suggestions
               if s.kind == "max_context"]
    (suggestion,) = shorter
    limit = suggestion.apply["slo"]["max_context"]
    assert limit % 1024 == 0 and limit < 32768
    too_long = PlanRequest.from_dict(req_dict(**SCENARIOS[0][1])).apply({"slo": {"max_context": limit + 1024}})
    assert not make_plan(too_long).feasible
