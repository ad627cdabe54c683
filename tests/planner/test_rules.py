"""The planner's rules: memory, latency, KV dtype choice, overrides, GPUs per replica, flags."""

from __future__ import annotations

import math

import pytest

from kvpilot.operator.planner import PlanRequest, make_plan
from kvpilot.operator.planner.kv_dtype import UNCALIBRATED_WARNING

MIB, GIB = 1 << 20, 1 << 30


def test_qwen3_8b_on_h100_by_hand(plan_for):
    """Every number of the reference plan, recomputed here from the documented model."""
    plan = plan_for(model="qwen3-8b", gpu="h100-80gb", concurrency=64, overrides={"tensor_parallel_size": 1})
    budget = int(int(79.11 * GIB) * 0.90)                 # CUDA-visible total x utilization
    weights = 8_190_735_360 * 2                           # published parameters x bf16
    forward = 8192 * 3 * (4096 + 12288) * 2               # 8,192 batched tokens x 3 x (hidden + inter.)
    sampler = math.ceil(64 * 151936 * 39.6)               # 64 sampled rows x vocab x 39.6 B
    reserve = 288 * MIB + max(forward, sampler)           # CUDA runtime + activation peak (TP 1: no NCCL)
    per_token = 2 * 36 * 8 * 128 * 2
    kv = int((budget - weights - reserve) * (1 - 0.03))   # less the 3% safety margin
    blocks = kv // (16 * per_token)
    assert plan.memory["reserve_bytes"] == reserve and forward > sampler
    assert (plan.kv_bytes_per_token, plan.num_gpu_blocks) == (per_token, blocks)
    assert plan.kv_cache_memory_bytes == blocks * 16 * per_token
    # one 32k sequence + (n - 1) sequences of 4096 + 1024 tokens
    assert plan.limits["kv_capacity"] == (blocks - 32768 // 16) // (5120 // 16) + 1
    assert plan.max_num_seqs == min(64, plan.limits["kv_capacity"])
    assert plan.replicas == math.ceil(64 / plan.max_num_seqs)


def test_feasible_plan_fits_in_the_budget(plan_for):
    plan = plan_for(model="llama-3.1-8b", gpu="a100-40gb", concurrency=32, ttft_p95_ms=1500, itl_p95_ms=60)
    m = plan.memory
    assert plan.feasible
    assert m["weight_bytes_per_gpu"] + m["reserve_bytes"] + plan.kv_cache_memory_bytes <= m["budget_bytes"]
    assert m["budget_bytes"] == int(0.90 * m["gpu_memory_bytes"])
    assert plan.estimates["itl_p95_ms"] <= 60 and plan.estimates["ttft_p95_ms"] <= 1500
    assert plan.max_num_batched_tokens >= plan.max_num_seqs


def test_itl_target_bounds_max_num_seqs(plan_for):
    loose = plan_for(model="qwen3-8b", gpu="h100-80gb", max_context=16384, p95_prompt_tokens=1024,
                     p95_output_tokens=512, overrides={"tensor_parallel_size": 1})
    tight = plan_for(model="qwen3-8b", gpu="h100-80gb", max_context=16384, p95_prompt_tokens=1024,
                     p95_output_tokens=512, itl_p95_ms=12, overrides={"tensor_parallel_size": 1})
    assert tight.feasible and tight.binding_constraint == "itl"
    assert tight.max_num_seqs < loose.max_num_seqs
    assert tight.estimates["itl_p95_ms"] <= 12
    # the step is memory-bound: weights + batch KV at 80% of 3,350 GB/s
    one_more = (tight.memory["weight_bytes_per_gpu"] + (tight.max_num_seqs + 1) * 1536 * tight.kv_bytes_per_token)
    assert one_more / (0.8 * 3350e9) * 1000 > 12
    # a full prefill chunk must fit in the ITL target too
    assert tight.max_num_batched_tokens < loose.max_num_batched_tokens == 8192


def test_fp8_not_chosen_for_short_contexts(plan_for):
    plan = plan_for(model="qwen3-8b", gpu="l4", max_context=8192, p95_prompt_tokens=4096,
                    p95_output_tokens=1024, concurrency=64, allow_fp8_kv=True,
                    overrides={"tensor_parallel_size": 1})
    assert plan.kv_cache_dtype == "auto"
    assert plan.limits["kv_capacity"] < 64                 # FP8 would have helped capacity...
    assert any("not considered" in line and "7,168" in line for line in plan.derivation)


def test_fp8_chosen_when_allowed_and_needed(plan_for):
    kwargs = dict(model="qwen3-8b", gpu="h100-80gb", max_context=32768, p95_prompt_tokens=8192,
                  p95_output_tokens=1024, concurrency=64, overrides={"tensor_parallel_size": 1})
    bf16 = plan_for(**kwargs)
    fp8 = plan_for(**kwargs, allow_fp8_kv=True)
    assert bf16.kv_cache_dtype == "auto" and bf16.max_num_seqs < 64
    assert fp8.kv_cache_dtype == "fp8" and fp8.max_num_seqs > bf16.max_num_seqs
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert UNCALIBRATED_WARNING in fp8.warnings
    assert "--kv-cache-dtype" in fp8.serve_args() and "fp8" in fp8.serve_args()


def test_fp8_not_chosen_when_16_bit_meets_the_target(plan_for):
    plan = plan_for(model="qwen3-8b", gpu="h200", max_context=32768, p95_prompt_tokens=8192,
                    p95_output_tokens=1024, concurrency=16, allow_fp8_kv=True)
    assert plan.feasible and plan.max_num_seqs == 16 and plan.kv_cache_dtype == "auto"


def test_fp8_not_chosen_for_head_dim_256_with_a_tight_ttft(plan_for):
    kwargs = dict(model="gemma-2-9b", gpu="a100-80gb", max_context=8192, p95_prompt_tokens=6144,
                  p95_output_tokens=1536, concurrency=200, allow_fp8_kv=True,
                  overrides={"tensor_parallel_size": 1})
    loose = plan_for(**kwargs, ttft_p95_ms=5000)
    assert loose.kv_cache_dtype == "fp8"                   # capacity-bound: FP8 helps
    ttft_16bit = plan_for(**{**kwargs, "allow_fp8_kv": False}, ttft_p95_ms=5000)
    tight_ms = math.ceil(ttft_16bit.estimates["ttft_single_sequence_ms"] * 1.3)
    tight = plan_for(**kwargs, ttft_p95_ms=tight_ms)       # 16-bit fits, 1.6x of it does not
    assert tight.feasible and tight.kv_cache_dtype == "auto"
    assert any("1.6x" in line for line in tight.derivation)


def test_pinned_fp8_on_short_context_warns(plan_for):
    plan = plan_for(model="qwen3-8b", max_context=4096, p95_prompt_tokens=2048, p95_output_tokens=512,
                    overrides={"kv_cache_dtype": "fp8"})
    assert plan.kv_cache_dtype == "fp8"
    assert any("below 7,168 tokens" in w for w in plan.warnings)


def test_pinned_overrides_are_used_and_checked(plan_for):
    plan = plan_for(model="qwen3-8b", concurrency=10,
                    overrides={"gpu_memory_utilization": 0.8, "block_size": 32, "max_num_seqs": 10,
                               "enable_prefix_caching": False})
    assert (plan.gpu_memory_utilization, plan.block_size, plan.max_num_seqs) == (0.8, 32, 10)
    assert plan.memory["budget_bytes"] == int(0.8 * int(79.11 * GIB))
    assert "--no-enable-prefix-caching" in plan.serve_args()
    too_many = plan_for(model="qwen3-8b", overrides={"tensor_parallel_size": 1, "max_num_seqs": 500})
    assert not too_many.feasible and too_many.binding_constraint == "kv_capacity"
    assert "pinned max_num_seqs 500" in too_many.binding_detail
    big_chunk = plan_for(model="qwen3-8b", itl_p95_ms=30, overrides={"max_num_batched_tokens": 16384})
    assert not big_chunk.feasible and big_chunk.binding_constraint == "itl"
    assert "pinned max_num_batched_tokens 16,384" in big_chunk.binding_detail


def test_pinned_replicas_checked_against_the_request_rate(plan_for):
    free = plan_for(model="qwen3-8b", requests_per_second=20, overrides={"tensor_parallel_size": 1})
    rps = free.estimates["requests_per_second_per_replica"]
    assert free.replicas == math.ceil(20 / (0.8 * rps)) > 1
    pinned = plan_for(model="qwen3-8b", requests_per_second=20,
                      overrides={"tensor_parallel_size": 1, "replicas": free.replicas - 1})
    assert not pinned.feasible and pinned.binding_constraint == "replicas"


def test_max_context_beyond_the_model_is_infeasible(plan_for):
    plan = plan_for(model="llama-2-7b", max_context=8192, p95_prompt_tokens=2048, p95_output_tokens=512)
    assert not plan.feasible and plan.binding_constraint == "max_position_embeddings"
    with pytest.raises(ValueError, match=r"p95 request \(5,120 tokens\) is longer than .*4,096 positions"):
        plan_for(model="llama-2-7b", max_context=8192)


def test_gpus_per_replica_minimises_gpus_in_total(req_dict):
    request = req_dict(model="llama-3.1-70b", gpu="h100-80gb", max_context=16384, p95_prompt_tokens=6000,
                       p95_output_tokens=2000, concurrency=128, itl_p95_ms=40)
    plan = make_plan(PlanRequest.from_dict(request))
    pinned = {tp: make_plan(PlanRequest.from_dict({**request, "overrides": {"tensor_parallel_size": tp}}))
              for tp in (1, 2, 4, 8)}
    assert not pinned[1].feasible and pinned[1].binding_constraint == "gpu_memory"
    total = {tp: p.replicas * tp for tp, p in pinned.items() if p.feasible}
    assert plan.feasible
    assert plan.tensor_parallel_size == min(total, key=lambda tp: (total[tp], tp))
    assert plan.tensor_parallel_size > min(total)          # more GPUs per replica, fewer in total
    assert plan.to_dict() | {"derivation": None} == pinned[plan.tensor_parallel_size].to_dict() | {"derivation": None}
    # without a concurrency or rate target every shape needs one replica: the smallest wins
    alone = {**request, "slo": {**request["slo"], "concurrency": None}}
    single = make_plan(PlanRequest.from_dict(alone))
    feasible = [tp for tp in (1, 2, 4, 8) if make_plan(PlanRequest.from_dict(
        {**alone, "overrides": {"tensor_parallel_size": tp}})).feasible]
    assert single.replicas == 1 and single.tensor_parallel_size == min(feasible)


def test_tensor_parallel_size_must_split_the_heads(req_dict):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .* valid: 1, 2, 4, 8, 16, 32"):
        make_plan(PlanRequest.from_dict(req_dict(overrides={"tensor_parallel_size": 3})))


def test_serve_args_flags(plan_for):
    one = plan_for(model="qwen3-8b", concurrency=16, overrides={"tensor_parallel_size": 1})
    flags = one.serve_args()
    pairs = dict(zip(flags[::2], flags[1::2], strict=False))
    assert pairs["--max-model-len"] == "32768" and pairs["--block-size"] == "16"
    assert pairs["--kv-cache-memory-bytes"] == str(one.kv_cache_memory_bytes)
    assert pairs["--gpu-memory-utilization"] == "0.9" and pairs["--kv-cache-dtype"] == "auto"
    assert "--tensor-parallel-size" not in flags and "--kv-offloading-size" not in flags
    assert "--enable-prefix-caching" in flags
    two = plan_for(model="qwen3-8b", concurrency=16, overrides={"tensor_parallel_size": 2})
    assert two.serve_args()[-2:] == ["--tensor-parallel-size", "2"]


def test_prefix_tiers_and_host_memory(plan_for):
    plan = plan_for(model="qwen3-8b", concurrency=32, shared_prefix_tokens=2048, distinct_prefixes=400,
                    overrides={"tensor_parallel_size": 1})
    per_prefix = 2048 * plan.kv_bytes_per_token                   # 288 MiB
    on_gpu = plan.resident_prefix_tokens // 2048
    assert 0 < on_gpu < 400
    assert plan.cpu_offload_gib == math.ceil((400 - on_gpu) * per_prefix / GIB)
    assert plan.disk_offload_gib == 0 and plan.offload_backend == "native"
    assert plan.shm_gib == plan.cpu_offload_gib + 1
    assert plan.pod_memory_gib == 4 + 2 + plan.shm_gib
    args = plan.serve_args()
    assert args[args.index("--kv-offloading-size") + 1] == str(plan.cpu_offload_gib)
    assert "--kv-offloading-disk-path" not in args
    capped = plan_for(model="qwen3-8b", concurrency=32, shared_prefix_tokens=2048, distinct_prefixes=400,
                      overrides={"tensor_parallel_size": 1, "cpu_offload_gib": 16})
    assert capped.cpu_offload_gib == 16 and capped.disk_offload_gib > 0 and capped.offload_backend == "native"
    assert "--kv-offloading-disk-path" in capped.serve_args()


def test_no_offload_tiers_for_a_model_that_releases_windowed_blocks(plan_for):
    """Gemma 2 (every other layer slides over 4,096 tokens) at an 8k context has a hybrid
    KV cache, and the engine refuses KV offload for it (tests/engine/test_hybrid_kv_cache.py):
    prefixes that miss the GPU are left uncached, pinned tiers are left out with a warning."""
    kwargs = dict(model="gemma-2-9b", max_context=8192, concurrency=32, shared_prefix_tokens=2048,
                  distinct_prefixes=400)
    plan = plan_for(**kwargs, overrides={"tensor_parallel_size": 1})
    assert plan.num_sliding_pool_layers == 21 and plan.sliding_window == 4096
    assert (plan.cpu_offload_gib, plan.disk_offload_gib, plan.offload_backend) == (0, 0, None)
    assert "--kv-offloading-size" not in plan.serve_args()
    assert any("shared prefixes fit in no tier" in w for w in plan.warnings)
    pinned = plan_for(**kwargs, overrides={"tensor_parallel_size": 1, "cpu_offload_gib": 16})
    assert pinned.cpu_offload_gib == 0 and "--kv-offloading-size" not in pinned.serve_args()
    assert any("does not offload KV for a sliding-window model" in w for w in pinned.warnings)
    short = plan_for(**{**kwargs, "max_context": 4096, "p95_prompt_tokens": 3000, "p95_output_tokens": 500},
                     overrides={"tensor_parallel_size": 1})
    assert short.num_sliding_pool_layers == 0 and short.cpu_offload_gib > 0   # nothing released


def test_shared_prefix_shortens_ttft(plan_for):
    kwargs = dict(model="qwen3-8b", max_context=16384, p95_prompt_tokens=8192, p95_output_tokens=512,
                  concurrency=16, ttft_p95_ms=5000)
    cold = plan_for(**kwargs)
    warm = plan_for(**kwargs, shared_prefix_tokens=6000)
    assert warm.estimates["ttft_single_sequence_ms"] < cold.estimates["ttft_single_sequence_ms"]
