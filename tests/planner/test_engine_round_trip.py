"""Round trip: an engine started with the plan's kv_cache_memory_bytes, KV dtype and block
size reports exactly the plan's num_gpu_blocks (one shared torch-free formula)."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM
from kvpilot.operator.planner import PlanRequest, make_plan


@pytest.mark.parametrize("kv_cache_dtype, block_size", [("auto", 16), ("fp8_e4m3", 32), ("fp8", 16)])
def test_engine_allocates_the_planned_blocks(demo_model_dir, kv_cache_dtype, block_size):
    request = PlanRequest.from_dict({
        "model": str(demo_model_dir / "config.json"),
        "gpu": {"name": "l4", "memory_gib": 1.25},
        "slo": {"max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256, "concurrency": 4},
        "overrides": {"kv_cache_dtype": kv_cache_dtype, "block_size": block_size},
    })
    plan = make_plan(request)
    assert plan.feasible, plan.binding_constraint
    assert plan.kv_cache_memory_bytes < 1 << 30          # small enough to allocate on this CPU
    # The demo checkpoint is bfloat16: compute in bfloat16 so "auto" means the same KV dtype.
    llm = LLM(str(demo_model_dir), dtype="bfloat16", kv_cache_memory_bytes=plan.kv_cache_memory_bytes,
              kv_cache_dtype=plan.kv_cache_dtype, block_size=plan.block_size,
              max_model_len=plan.max_model_len)
    info = llm.llm_engine.cache_info
    assert info.num_gpu_blocks == plan.num_gpu_blocks
    assert info.bytes_per_block == plan.kv_bytes_per_token * plan.block_size
    assert info.kv_cache_memory_bytes == plan.kv_cache_memory_bytes
    assert info.token_capacity == plan.kv_token_capacity


@pytest.mark.slow
def test_two_gpu_engine_allocates_the_planned_per_gpu_blocks(demo_model_dir):
    """Tensor parallelism: the plan's figures are per GPU (one rank's KV heads); every rank
    of an engine started with them allocates exactly the plan's blocks."""
    request = PlanRequest.from_dict({
        "model": str(demo_model_dir / "config.json"),
        "gpu": {"name": "l4", "memory_gib": 1.5},
        "slo": {"max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256, "concurrency": 4},
        "overrides": {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "block_size": 16},
    })
    plan = make_plan(request)
    assert plan.feasible, plan.binding_constraint
    assert plan.tensor_parallel_size == 2 and plan.num_kv_heads_per_gpu == 1   # 2 KV heads, split
    assert plan.kv_cache_memory_bytes < 1 << 30
    llm = LLM(str(demo_model_dir), dtype="bfloat16", tensor_parallel_size=2,
              kv_cache_memory_bytes=plan.kv_cache_memory_bytes, kv_cache_dtype=plan.kv_cache_dtype,
              block_size=plan.block_size, max_model_len=plan.max_model_len)
    try:
        info = llm.llm_engine.cache_info
        assert info.num_gpu_blocks == plan.num_gpu_blocks
        assert llm.llm_engine.runner.num_blocks_per_rank == [plan.num_gpu_blocks] * 2
        assert info.bytes_per_block == plan.kv_bytes_per_token * plan.block_size
        assert info.kv_cache_memory_bytes == plan.kv_cache_memory_bytes
        assert info.token_capacity == plan.kv_token_capacity
    finally:
        llm.llm_engine.close()
