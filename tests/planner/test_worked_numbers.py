"""The issue's worked numbers: KV bytes per token, per sequence, FP8 halving, 7B weights."""

from __future__ import annotations

import pytest

from kvpilot.contract.kv_layout import KVLayout
from kvpilot.operator.planner import preset_model

MIB, GIB = 1 << 20, 1 << 30


def test_qwen3_0_6b_bytes_per_token_and_4k_sequence(plan_for):
    plan = plan_for(model="qwen3-0.6b", gpu="l4", max_context=4096, p95_prompt_tokens=3072,
                    p95_output_tokens=1024, overrides={"tensor_parallel_size": 1})
    assert (plan.num_layers, plan.num_kv_heads_per_gpu, plan.head_dim, plan.kv_dtype_bytes) == (28, 8, 128, 2)
    assert plan.kv_bytes_per_token == 114_688 == 112 * 1024
    assert plan.kv_bytes_per_token * 4096 == 448 * MIB
    assert plan.memory["max_context_blocks"] * plan.memory["bytes_per_block"] == 448 * MIB


def test_llama2_7b_bytes_per_token_and_4k_sequence(plan_for):
    plan = plan_for(model="llama-2-7b", gpu="a100-80gb", max_context=4096, p95_prompt_tokens=3072,
                    p95_output_tokens=1024, overrides={"tensor_parallel_size": 1})
    assert preset_model("llama-2-7b").dtype == "float16"
    assert (plan.num_layers, plan.num_kv_heads_per_gpu, plan.head_dim, plan.kv_dtype_bytes) == (32, 32, 128, 2)
    assert plan.kv_bytes_per_token == 524_288
    assert plan.kv_bytes_per_token * 4096 == 2 * GIB


@pytest.mark.parametrize("model, per_token, per_4k", [("qwen3-0.6b", 114_688, 448 * MIB),
                                                      ("llama-2-7b", 524_288, 2 * GIB)])
def test_fp8_halves_both(plan_for, model, per_token, per_4k):
    plan = plan_for(model=model, gpu="a100-80gb", max_context=4096, p95_prompt_tokens=3072,
                    p95_output_tokens=1024, overrides={"tensor_parallel_size": 1, "kv_cache_dtype": "fp8"})
    assert plan.kv_cache_dtype == "fp8" and plan.kv_dtype_bytes == 1
    assert plan.kv_bytes_per_token == per_token // 2
    assert plan.kv_bytes_per_token * 4096 == per_4k // 2


def test_7b_fp16_weights_are_about_13_gib(plan_for):
    plan = plan_for(model="llama-2-7b", gpu="a100-80gb", max_context=4096, p95_prompt_tokens=3072,
                    p95_output_tokens=1024, overrides={"tensor_parallel_size": 1})
    weights = plan.memory["weight_bytes_total"]
    assert weights == 6_738_415_616 * 2          # published parameter count x fp16
    assert abs(weights / GIB - 13) < 0.5          # 12.55 GiB
    assert plan.memory["weight_bytes_per_gpu"] == weights


def test_tensor_parallel_splits_kv_heads_and_weights(plan_for):
    one = plan_for(model="llama-2-7b", gpu="a100-80gb", max_context=4096, p95_prompt_tokens=3072,
                   p95_output_tokens=1024, overrides={"tensor_parallel_size": 1})
    four = plan_for(model="llama-2-7b", gpu="a100-80gb", max_context=4096, p95_prompt_tokens=3072,
                    p95_output_tokens=1024, overrides={"tensor_parallel_size": 4})
    assert four.kv_bytes_per_token * 4 == one.kv_bytes_per_token
    assert four.memory["weight_bytes_per_gpu"] == one.memory["weight_bytes_total"] // 4


def test_kv_heads_are_replicated_when_fewer_than_ranks(plan_for):
    # Qwen2.5-7B has 4 KV heads; at TP 8 each rank keeps one (replicated) head, as vLLM does.
    plan = plan_for(model="qwen2.5-7b", gpu="l4", max_context=8192, p95_prompt_tokens=2048,
                    p95_output_tokens=512, overrides={"tensor_parallel_size": 4})
    assert plan.num_kv_heads_per_gpu == 1
    assert plan.kv_bytes_per_token == 2 * 28 * 1 * 128 * 2


def test_num_gpu_blocks_comes_from_the_shared_kv_formula(plan_for):
    plan = plan_for(model="qwen3-8b", gpu="h100-80gb", concurrency=64)
    layout = KVLayout(36, 8, 128, 2, 16)
    assert plan.kv_layout == layout
    assert layout.num_blocks(plan.kv_cache_memory_bytes) == plan.num_gpu_blocks
    assert layout.num_blocks(plan.memory["kv_available_bytes"]) == plan.num_gpu_blocks
    assert plan.kv_token_capacity == plan.num_gpu_blocks * 16


def test_engine_cache_config_resolves_the_plans_dtype_to_the_same_bytes(plan_for):
    config = pytest.importorskip("kvpilot.engine.config")
    for overrides in ({}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e5m2"}):
        plan = plan_for(model="qwen3-8b", gpu="h100-80gb", concurrency=8,
                        overrides={"tensor_parallel_size": 1, **overrides})
        cache = config.CacheConfig(block_size=plan.block_size, kv_cache_dtype=plan.kv_cache_dtype,
                                   kv_cache_memory_bytes=plan.kv_cache_memory_bytes)
        assert cache.kv_dtype_bytes("bfloat16") == plan.kv_dtype_bytes
        assert cache.kv_dtype_name("bfloat16") == plan.kv_dtype_name


def test_fp8_weights_keep_the_embeddings_16_bit(plan_for):
    # Llama-3.3-70B-Instruct-FP8-dynamic: vLLM loads 33.88 GiB per GPU at TP 2 (llm-d's H100 logs)
    plan = plan_for(model="llama-3.1-70b", gpu="h100-80gb", max_context=16000, p95_prompt_tokens=2048,
                    p95_output_tokens=512, overrides={"tensor_parallel_size": 2, "weight_quantization": "fp8"})
    embeddings = 2 * 128256 * 8192                      # untied input embedding + LM head
    assert plan.memory["weight_bytes_total"] == (70_553_706_496 - embeddings) * 1 + embeddings * 2
    assert abs(plan.memory["weight_bytes_per_gpu"] / GIB - 33.88) < 0.1
