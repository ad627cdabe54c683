"""Sliding-window models give HF transformers' greedy tokens (float32) and hold bounded KV.

Two tiny checkpoints with a 32-token window, prompts up to 150 tokens: Mistral (every
layer slides, so blocks outside the window are released) and Qwen2 with mixed layers
(``use_sliding_window``, ``max_window_layers=1``: layer 0 full, layer 1 windowed; a
hybrid KV cache, each kind of layer with its own pool and block tables, the windowed
one releasing what falls outside the window). Each runs plain with prefix hits,
with chunked prefill under a small budget, and with a pool small enough to preempt, on
the torch backend; a shorter run goes through the Triton kernels (the interpreter on CPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvpilot.contract.kv_layout import blocks_held
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager

from support.hf_oracle import MAX_NEW, hf_greedy
from support.one_request import steps_of_one_request

WINDOW = 32
KINDS = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2-mixed": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    shared = rand(70)
    return [rand(n) for n in (1, 20, 33, 64, 150)] + [shared + rand(n) for n in (5, 40)] + [shared[:48]]


@pytest.fixture(scope="module", params=sorted(KINDS))
def case(request, tiny_checkpoint):
    kind = request.param.split("-")[0]
    path = tiny_checkpoint(kind, **KINDS[request.param])
    prompts = make_prompts(seed=len(request.param))
    expected = hf_greedy(path, prompts)
    # The oracle depends on the window: the same weights without it answer differently.
    unwindowed = tiny_checkpoint(kind, **{**KINDS[request.param], "sliding_window": None})
    assert hf_greedy(unwindowed, prompts) != expected
    return request.param, path, prompts, expected


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\nA1 {text}")


@pytest.mark.slow
def test_plain_and_prefix_hits(case, capsys):
    name, path, prompts, expected = case
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=256, max_model_len=256)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.release_window == WINDOW
    assert isinstance(engine.kv_cache_manager, HybridKVCacheManager) == (name == "qwen2-mixed")
    assert generate(llm, prompts) == expected
    first = llm.get_stats().prefix_cache_hits
    assert generate(llm, prompts) == expected
    hits = llm.get_stats().prefix_cache_hits - first
    assert hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert llm.get_stats().kv_cache_usage == 0.0
    _report(capsys, f"{name}: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
                    f"tokens (window {WINDOW}) x {MAX_NEW} greedy tokens == HF float32; second pass "
                    f"{hits} prefix-hit tokens, same tokens")


@pytest.mark.slow
def test_chunked_prefill_and_preemption(case, capsys):
    name, path, prompts, expected = case
    chunked = LLM(str(path), dtype="float32", num_gpu_blocks=256, max_model_len=256, max_num_batched_tokens=24)
    assert generate(chunked, prompts) == expected
    # Mistral needs only its window per sequence: a far smaller pool still preempts.
    blocks = 10 if name == "mistral" else 16
    tiny = LLM(str(path), dtype="float32", num_gpu_blocks=blocks, max_model_len=160, max_num_batched_tokens=32)
    assert generate(tiny, prompts) == expected
    assert tiny.get_stats().num_preemptions > 0
    assert tiny.get_stats().kv_cache_usage == 0.0
    _report(capsys, f"{name}: == HF with chunked prefill (24-token budget) and with a {blocks}-block "
                    f"pool ({tiny.get_stats().num_preemptions} preemptions)")


@pytest.mark.slow
def test_tensor_parallel_windows(case):
    """Two ranks: each attends over the window with its own heads; the driver releases.
    The mixed model's windowed pool (10 blocks for 2 sequences) is smaller than its full
    pool, so the workers must get each group's tables to match HF."""
    name, path, prompts, expected = case
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=24,
              max_num_seqs=2, tensor_parallel_size=2)
    try:
        kv = llm.llm_engine.kv_cache_manager
        if name == "qwen2-mixed":
            assert isinstance(kv, HybridKVCacheManager) and kv.sliding.pool.num_blocks == 10
        assert generate(llm, prompts[3:6]) == expected[3:6]
    finally:
        llm.llm_engine.close()


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter")
def test_triton_backend(case, capsys):
    name, path, prompts, _ = case
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    short = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (9, 30)] + [prompts[3]]
    expected = hf_greedy(path, short, max_new=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", num_gpu_blocks=64, max_model_len=128,
              max_num_batched_tokens=24)
    assert generate(llm, short, params) == expected
    assert llm.get_stats().prefix_cache_hits > 0
    _report(capsys, f"{name}: Triton backend == HF for {len(short)} prompts of "
                    f"{', '.join(str(len(p)) for p in short)} tokens, chunked (24), "
                    f"{llm.get_stats().prefix_cache_hits} prefix-hit tokens")


def test_mistral_holds_at_most_window_plus_one_block(tiny_checkpoint, capsys):
    """A2: a 400-token sequence of the all-windowed model never holds more than
    window + block_size tokens of KV while it decodes (nor more than the window plus a
    chunk while it prefills), and the planner counts the same blocks."""
    from kvpilot.operator.planner.catalog import model_from_path
    from kvpilot.operator.planner.memory import blocks_for

    path = tiny_checkpoint("mistral", **KINDS["mistral"])
    chunk, block_size = 32, 16
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=512, max_num_batched_tokens=chunk)
    kv = llm.llm_engine.kv_cache_manager
    prefill_peak = decode_peak = 0
    for request in steps_of_one_request(llm, 300, 100):
        held = kv.num_held_blocks("long")
        assert held == kv.pool.num_blocks - kv.pool.num_free_blocks     # the only request
        if request.num_output_tokens <= 1:
            prefill_peak = max(prefill_peak, held)
        else:
            decode_peak = max(decode_peak, held)
    total = 300 + 100
    full_blocks = -(-total // block_size)
    assert decode_peak * block_size <= WINDOW + block_size
    assert decode_peak == blocks_held(total, block_size, WINDOW) == WINDOW // block_size + 1
    assert prefill_peak <= blocks_held(total, block_size, WINDOW - 1 + chunk)
    planner_model = model_from_path(path)
    assert planner_model.kv_release_window == WINDOW
    assert blocks_for(planner_model, total, block_size) == decode_peak
    with capsys.disabled():
        print(f"\nA2 sliding window {WINDOW}, block {block_size}, {total}-token sequence: "
              f"decode holds {decode_peak} blocks = {decode_peak * block_size} tokens per layer "
              f"(window + block = {WINDOW + block_size}); prefill chunks of {chunk} hold "
              f"{prefill_peak} blocks; without release {full_blocks} blocks; planner "
              f"blocks_for = {blocks_for(planner_model, total, block_size)}")


@pytest.mark.slow
def test_planner_capacity_matches_the_engine(tiny_checkpoint, capsys):
    """A2: the plan for the all-windowed model (pinned KV bytes) names the engine's block
    count, and its KV-capacity concurrency, all running at the p95 length at once, runs
    without a preemption in an engine started with the plan's flags."""
    from kvpilot.operator.planner import PlanRequest, make_plan

    path = tiny_checkpoint("mistral", **KINDS["mistral"])
    plan = make_plan(PlanRequest.from_dict({
        "model": str(path), "gpu": {"name": "l4", "memory_gib": 1.0},
        "slo": {"max_context": 128, "p95_prompt_tokens": 40, "p95_output_tokens": 60},
        "overrides": {"kv_cache_memory_bytes": 50 * 16 * 512, "block_size": 16,
                      "max_num_batched_tokens": 32}}))
    assert plan.feasible and plan.binding_constraint == "kv_capacity"
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=plan.kv_cache_memory_bytes, block_size=plan.block_size,
              max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
              max_num_batched_tokens=plan.max_num_batched_tokens, kv_cache_dtype=plan.kv_cache_dtype)
    engine = llm.llm_engine
    assert engine.cache_info.num_gpu_blocks == plan.num_gpu_blocks
    rng = random.Random(9)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(plan.max_num_seqs):
        engine.add_request(str(i), [rng.randrange(3, 512) for _ in range(40)], params)
    peak_running = peak_used = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
        pool = engine.kv_cache_manager.pool
        peak_used = max(peak_used, pool.num_blocks - pool.num_free_blocks)
    assert engine.scheduler.num_preemptions == 0
    assert peak_running == plan.max_num_seqs
    with capsys.disabled():
        print(f"\nA2 planner vs engine (tiny Mistral, window {WINDOW}): plan num_gpu_blocks "
              f"{plan.num_gpu_blocks}, engine {engine.cache_info.num_gpu_blocks}; plan max_num_seqs "
              f"{plan.max_num_seqs} (limits {plan.limits}); engine ran {peak_running} sequences of 100 "
              f"tokens at once, peak {peak_used} blocks in use, 0 preemptions")


def test_offload_is_refused_when_blocks_are_released(tiny_checkpoint):
    path = str(tiny_checkpoint("mistral", **KINDS["mistral"]))
    with pytest.raises(ValueError, match="sliding-window models"):
        LLM(path, dtype="float32", num_gpu_blocks=64, max_model_len=256, kv_offloading_size=0.01)


def test_a_windowed_prefix_hit_longer_than_the_pool_is_admitted():
    """Blocks before the window are given back before new ones are taken, and a hit's
    blocks before the window are not taken at all: a 6-block pool admits a request whose
    cached prefix alone is 5 blocks and whose table needs 7."""
    from kvpilot.engine.core.block_hash import root_hash
    from kvpilot.engine.core.kv_cache_manager import KVCacheManager
    from kvpilot.engine.core.request import Request

    kv = KVCacheManager(6, 4, enable_caching=True, hash_root=root_hash("t"), release_window=8)
    prompt = list(range(100, 121))                          # 21 tokens: 5 full blocks + 1
    first = Request("a", prompt, SamplingParams(max_tokens=1))
    kv.update_block_hashes(first)
    while first.num_computed_tokens < len(prompt):          # chunks of 4, as the scheduler would
        step = min(4, len(prompt) - first.num_computed_tokens)
        assert kv.allocate_slots(first, step)
        assert kv.num_held_blocks("a") <= blocks_held(len(prompt), 4, 8 - 1 + 4)
        first.num_computed_tokens += step
    kv.free(first)
    second = Request("b", prompt + [7, 8, 9, 10], SamplingParams(max_tokens=1))
    hit = kv.find_prefix_hit(second)
    assert len(hit.blocks) == 5
    assert kv.num_blocks_needed(second, 5, hit) <= kv.num_free_blocks == 6
    assert kv.allocate_slots(second, 5, hit)
    second.num_computed_tokens = hit.num_tokens
    assert kv.num_held_blocks("b") == 4                    # blocks 3..6 of its 7
    assert kv.num_free_blocks == 2
    kv.free(second)
    assert kv.num_free_blocks == 6
