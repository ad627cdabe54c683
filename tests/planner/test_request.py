"""Building requests from plain data (the operator's path) and its error messages."""

from __future__ import annotations

import pytest

from kvpilot.operator.planner import (
    PlanRequest,
    get_gpu,
    gpu_names,
    make_plan,
    model_presets,
    preset_model,
)

GIB = 1 << 30
SLO = {"max_context": 8192, "p95_prompt_tokens": 2048, "p95_output_tokens": 512}


def test_to_dict_round_trip_and_purity():
    request = PlanRequest.from_dict({"model": "qwen3-8b", "gpu": "h100-80gb",
                                     "slo": {**SLO, "concurrency": 8, "itl_p95_ms": 40},
                                     "overrides": {"block_size": 32}})
    again = PlanRequest.from_dict(request.to_dict())
    assert again == request
    assert make_plan(request) == make_plan(again)


def test_camel_case_keys_as_in_a_crd():
    request = PlanRequest.from_dict({
        "model": {"preset": "qwen3-8b"}, "gpu": {"name": "h100-80gb", "memoryGib": 94},
        "slo": {"maxContext": 8192, "p95PromptTokens": 2048, "p95OutputTokens": 512, "allowFp8Kv": True},
        "overrides": {"tensorParallelSize": 1, "gpuMemoryUtilization": 0.85}})
    assert request.slo.allow_fp8_kv is True and request.overrides.tensor_parallel_size == 1
    assert request.gpu.memory_bytes == 94 * GIB and request.gpu.name == "h100-80gb"
    assert make_plan(request).memory["budget_bytes"] == int(0.85 * 94 * GIB)


def test_model_and_gpu_forms():
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
           "torch_dtype": "float16"}
    from_config = PlanRequest.from_dict({"model": {"config": cfg, "name": "my-llama"}, "gpu": "a100-80gb",
                                         "slo": SLO}).model
    assert from_config.num_params == preset_model("llama-2-7b").num_params
    assert from_config.num_kv_heads == 32 and from_config.name == "my-llama"
    explicit = PlanRequest.from_dict({"model": preset_model("gemma-2-9b").to_dict(), "gpu": "l4",
                                      "slo": SLO}).model
    assert explicit == preset_model("gemma-2-9b")
    custom = PlanRequest.from_dict({"model": "qwen3-8b", "slo": SLO, "gpu": {
        "name": "custom", "memory_gib": 48, "memory_bandwidth_gbps": 864, "bf16_tflops": 362}}).gpu
    assert (custom.memory_bytes, custom.memory_bandwidth_bytes_per_s, custom.bf16_flops) == (48 * GIB, 864e9, 362e12)
    assert get_gpu("H100") == get_gpu("h100-80gb")
    assert "b200" in gpu_names() and "qwen3-32b" in model_presets()


def test_apply_merges_sections_and_replaces_model_or_gpu():
    request = PlanRequest.from_dict({"model": "qwen3-8b", "gpu": {"name": "l4", "memory_gib": 20},
                                     "slo": {**SLO, "concurrency": 4}, "overrides": {"block_size": 32}})
    patched = request.apply({"gpu": "h200", "slo": {"concurrency": 16}, "overrides": {"block_size": None}})
    assert patched.gpu == get_gpu("h200")
    assert patched.slo.concurrency == 16 and patched.slo.max_context == 8192
    assert patched.overrides.block_size is None
    assert request.slo.concurrency == 4                      # the original is untouched


@pytest.mark.parametrize("data, message", [
    ({"model": "qwen3-8b", "gpu": "l4"}, "needs a 'slo' section"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": SLO, "extra": 1}, "unknown request section(s): extra"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": {**SLO, "p99_ttft": 5}}, "unknown slo field(s): p99_ttft"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": {**SLO, "concurrency": "lots"}}, "concurrency must be an integer"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": {**SLO, "concurrency": 0}}, "concurrency must be > 0"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": {**SLO, "max_context": 1000}}, "exceed max_context"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": {**SLO, "shared_prefix_tokens": 4096}}, "cannot exceed p95_prompt"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": {**SLO, "p50_output_tokens": 600}}, "must not exceed"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": SLO, "overrides": {"kv_cache_dtype": "int4"}},
     "kv_cache_dtype must be one of auto, fp8"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": SLO, "overrides": {"gpu_memory_utilization": 1.5}},
     "gpu_memory_utilization must be in (0, 1]"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": SLO, "overrides": {"block_size": 12}}, "block_size must be one of"),
    ({"model": "qwen3-8b", "gpu": "l4", "slo": SLO, "overrides": {"weight_quantization": "nf3"}},
     "weight_quantization must be one of fp8"),
    ({"model": "qwen3-8b", "gpu": {"name": "l4", "vram": 3}, "slo": SLO}, "unknown gpu field(s): vram"),
    ({"model": {"num_layers": 2}, "gpu": "l4", "slo": SLO}, "missing"),
    ({"model": 7, "gpu": "l4", "slo": SLO}, "model must be a name or a mapping"),
])
def test_bad_requests_are_rejected_clearly(data, message):
    with pytest.raises(ValueError, match=None) as info:
        PlanRequest.from_dict(data)
    assert message in str(info.value)
