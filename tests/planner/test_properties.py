"""Property tests of the planner's monotonicity and no-preemption guarantees.

The deployment shape is held fixed (GPUs per replica pinned: tensor parallel size and one
pipeline stage): with automatic shape search the planner may legitimately add GPUs or
nodes, which changes every number (6 GiB L4s planned across two nodes hold more KV than
7 GiB ones on one).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.operator.planner import PlanRequest, make_plan, preset_model

MODELS = ["qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "gemma-2-9b"]
GPUS = ["l4", "a10g", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "b200"]
# PLANNER_EXAMPLES=2000 for a longer hunt; 60 keeps the default run around a second per property
SETTINGS = settings(max_examples=int(os.environ.get("PLANNER_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def requests(draw, fixed_dtype: bool = False):
    """A request dict with a random model, GPU, workload and targets (shape pinned)."""
    model = draw(st.sampled_from(MODELS))
    spec = preset_model(model)
    prompt = draw(st.integers(16, min(12000, spec.max_position_embeddings // 2)))
    output = draw(st.integers(1, min(4000, spec.max_position_embeddings // 2)))
    max_context = draw(st.integers(prompt + output, max(prompt + output, spec.max_position_embeddings)))
    slo = {"max_context": max_context, "p95_prompt_tokens": prompt, "p95_output_tokens": output,
           "allow_fp8_kv": draw(st.booleans())}
    if draw(st.booleans()):
        slo["concurrency"] = draw(st.integers(1, 512))
    if draw(st.booleans()):
        slo["requests_per_second"] = draw(st.floats(0.1, 50))
    if draw(st.booleans()):
        slo["ttft_p95_ms"] = draw(st.floats(50, 30000))
    if draw(st.booleans()):
        slo["itl_p95_ms"] = draw(st.floats(5, 300))
    if draw(st.booleans()):
        slo["shared_prefix_tokens"] = draw(st.integers(0, prompt))
        slo["distinct_prefixes"] = draw(st.integers(1, 64))
    overrides = {"tensor_parallel_size": draw(st.sampled_from(spec.valid_tensor_parallel_sizes((1, 2, 4)))),
                 "pipeline_parallel_size": 1}
    if fixed_dtype:
        slo["allow_fp8_kv"] = False
        overrides["kv_cache_dtype"] = draw(st.sampled_from(["auto", "fp8"]))
    return {"model": model, "gpu": {"name": draw(st.sampled_from(GPUS))}, "slo": slo, "overrides": overrides}


def _plan(request: dict, **patch):
    slo = {**request["slo"], **patch.pop("slo", {})}
    gpu = {**request["gpu"], **patch.pop("gpu", {})}
    return make_plan(PlanRequest.from_dict({**request, "slo": slo, "gpu": gpu}))


@SETTINGS
@given(requests(), st.floats(6, 150), st.floats(0.01, 60))
def test_more_gpu_memory_never_lowers_max_num_seqs(request, memory, extra):
    small = _plan(request, gpu={"memory_gib": memory})
    large = _plan(request, gpu={"memory_gib": memory + extra})
    assert large.memory["kv_available_bytes"] >= small.memory["kv_available_bytes"]
    if small.feasible:
        assert large.feasible
        assert large.max_num_seqs >= small.max_num_seqs


@SETTINGS
@given(requests(fixed_dtype=True), st.floats(6, 150), st.floats(0.01, 60))
def test_more_gpu_memory_never_lowers_capacity(request, memory, extra):
    """For a given KV dtype. (When FP8 is allowed, more memory can let 16-bit KV meet the
    target again; the planner then prefers 16-bit, with fewer but wider token slots.)"""
    small = _plan(request, gpu={"memory_gib": memory})
    large = _plan(request, gpu={"memory_gib": memory + extra})
    assert large.kv_token_capacity >= small.kv_token_capacity
    assert large.num_gpu_blocks >= small.num_gpu_blocks
    if small.feasible:
        assert large.feasible and large.max_num_seqs >= small.max_num_seqs


@SETTINGS
@given(requests(), st.integers(1, 65536))
def test_longer_max_context_never_raises_max_num_seqs(request, extra):
    short = _plan(request)
    longer = _plan(request, slo={"max_context": request["slo"]["max_context"] + extra})
    if longer.feasible:
        assert short.feasible
        assert short.max_num_seqs >= longer.max_num_seqs


@SETTINGS
@given(requests(), st.floats(1, 300), st.floats(0.01, 300))
def test_tighter_itl_never_raises_max_num_seqs(request, itl, extra):
    tight = _plan(request, slo={"itl_p95_ms": itl})
    loose = _plan(request, slo={"itl_p95_ms": itl + extra})
    if tight.feasible:
        assert loose.feasible
        assert tight.max_num_seqs <= loose.max_num_seqs


@SETTINGS
@given(requests())
def test_feasible_plans_never_preempt_in_steady_state(request):
    plan = _plan(request)
    if not plan.feasible:                   # then: named binding constraint, a suggestion that works
        assert plan.binding_constraint in {c.name for c in plan.checks if not c.ok}
        assert plan.suggestions
        fixed = PlanRequest.from_dict(request).apply(plan.suggestions[0].apply)
        assert make_plan(fixed).feasible
        return
    model, slo = preset_model(request["model"]), request["slo"]
    seq = slo["p95_prompt_tokens"] + slo["p95_output_tokens"]
    # token slots of a p95 sequence: its length, window-capped on sliding layers (Gemma 2)
    assert plan.max_num_seqs * model.kv_tokens(seq) + plan.resident_prefix_tokens <= plan.kv_token_capacity
    if not model.num_sliding_layers:
        assert plan.max_num_seqs * seq + plan.resident_prefix_tokens <= plan.kv_token_capacity
    # and one request at the full max_model_len always fits
    assert model.kv_tokens(plan.max_model_len) <= plan.kv_token_capacity
    assert plan.kv_layout.num_blocks(plan.kv_cache_memory_bytes) == plan.num_gpu_blocks
    for limit in ("itl_p95_ms", "ttft_p95_ms"):
        if limit in slo:
            assert plan.estimates[limit] <= slo[limit] * (1 + 1e-9)
