"""The planner-vs-engine contract for a hybrid KV cache, shared by the Qwen2 and Gemma 3 tests.

``plan_and_engine`` plans a pinned KV byte budget and starts the engine with the plan's
settings, checking that the engine holds the blocks the plan names (full pool, token
capacity, windowed pool); ``run_at_once`` then runs the plan's concurrency of p95-length
requests, for the caller to check it ran without a preemption.
"""

from __future__ import annotations

import random

from kvpilot.engine import LLM, SamplingParams


def plan_and_engine(path, kv_cache_memory_bytes: int, block_size: int, prompt_len: int, output_len: int,
                    max_context: int = 128, max_num_batched_tokens: int = 32):
    """``(plan, llm)`` for ``path`` at a pinned KV budget; asserts the engine's pools are
    the plan's."""
    from kvpilot.operator.planner import PlanRequest, make_plan

    plan = make_plan(PlanRequest.from_dict({
        "model": str(path), "gpu": {"name": "l4", "memory_gib": 1.0},
        "slo": {"max_context": max_context, "p95_prompt_tokens": prompt_len, "p95_output_tokens": output_len},
        "overrides": {"kv_cache_memory_bytes": kv_cache_memory_bytes, "block_size": block_size,
                      "max_num_batched_tokens": max_num_batched_tokens}}))
    assert plan.feasible and plan.binding_constraint == "kv_capacity"
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=plan.kv_cache_memory_bytes, block_size=plan.block_size,
              max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
              max_num_batched_tokens=plan.max_num_batched_tokens, kv_cache_dtype=plan.kv_cache_dtype)
    info, kv = llm.llm_engine.cache_info, llm.llm_engine.kv_cache_manager
    assert info.num_gpu_blocks == plan.num_gpu_blocks
    assert info.token_capacity == plan.kv_token_capacity
    assert info.kv_cache_memory_bytes == plan.kv_cache_memory_bytes
    assert kv.sliding.pool.num_blocks == plan.sliding_pool_blocks
    return plan, llm


def run_at_once(llm: LLM, num_requests: int, prompt_len: int, output_len: int, seed: int = 9) -> int:
    """Adds ``num_requests`` random prompts, steps until all finish; the peak number running."""
    engine = llm.llm_engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(str(i), [rng.randrange(3, 512) for _ in range(prompt_len)], params)
    peak_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
    return peak_running
