"""Tensor parallelism on CPU (gloo): two ranks, the driver and one worker process.

Oracles: HF transformers' greedy tokens (float32) on the very checkpoint, for three
head layouts: Qwen3 (GQA, 2 KV heads: one per rank), Qwen2 with tied embeddings (the
vocab-parallel embedding is the LM head), Llama with a single KV head (replicated on
both ranks). Each runs with a pool small enough to preempt, a token budget small enough
to chunk prefills, and prompts that share prefixes. With an fp8 KV cache (scales
calibrated on the first batch) two ranks must give exactly the one-rank tokens.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from kvpilot.engine import LLM, EngineArgs, EngineDeadError, LLMEngine, SamplingParams

from support.hf_oracle import MAX_NEW, assert_chunked_hits_and_preempted, hf_greedy, make_prompts
from support.worker_death import kill_worker_mid_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LAYOUTS = {
    "qwen3-gqa": ("qwen3", {}),
    "qwen2-gqa-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_match_hf_with_chunks_prefix_hits_and_preemption(layout, tiny_checkpoint):
    kind, overrides = LAYOUTS[layout]
    path = tiny_checkpoint(kind, **overrides)
    prompts = make_prompts(512, seed=sorted(LAYOUTS).index(layout))
    expected = hf_greedy(path, prompts)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_gpu_blocks=42, max_model_len=640,
              max_num_batched_tokens=64)
    try:
        runner = llm.llm_engine.runner
        heads = runner.model.layers[0].self_attn
        assert (heads.num_heads, heads.num_kv_heads) == (2, 1)     # this rank's share
        assert runner.num_blocks_per_rank == [42, 42]
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        assert_chunked_hits_and_preempted(llm.get_stats(), prompts, 64)
    finally:
        llm.llm_engine.close()


@pytest.mark.slow
def test_two_ranks_with_an_fp8_cache_equal_one_rank(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 60, 130, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", num_gpu_blocks=128, max_model_len=512, kv_cache_dtype="fp8_e4m3",
              calculate_kv_scales=True)
    one = LLM(path, **kw)
    expected = tokens(one.generate(prompts, params))
    two = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert two.llm_engine.cache_info.kv_cache_dtype == "fp8_e4m3"
        assert tokens(two.generate(prompts, params)) == expected
        # the scales come from the amax over both ranks' heads: the one-rank engine's (layer
        # 0 exactly; later layers' inputs went through all-reduces, summed in another order)
        scales = lambda llm: [s for a in llm.llm_engine.runner.model.layers  # noqa: E731
                              for s in (a.self_attn.k_scale.item(), a.self_attn.v_scale.item())]
        assert scales(two)[:2] == scales(one)[:2] != [1.0, 1.0]
        assert scales(two) == pytest.approx(scales(one), rel=1e-5)
    finally:
        two.llm_engine.close()


def test_sizes_that_cannot_split_the_model_are_refused_before_anything_starts(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))     # 4 query heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 cannot split Qwen3ForCausalLM: its 4 "
                                         r"attention heads do not split evenly over 3 GPUs; sizes that "
                                         r"work: 1, 2, 4"):
        LLM(path, dtype="float32", tensor_parallel_size=3, num_gpu_blocks=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs 2 GPUs \(cuda:0..cuda:1\) but "
                                         r"\d+ are visible"):
        LLM(path, dtype="float32", tensor_parallel_size=2, device="cuda", num_gpu_blocks=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, 8\]"):
        LLM(path, dtype="float32", tensor_parallel_size=16, num_gpu_blocks=64)
    with pytest.raises(ValueError, match="KV offloading is not implemented with tensor parallelism"):
        LLM(path, dtype="float32", tensor_parallel_size=2, num_gpu_blocks=64, kv_offloading_size=0.1)


@pytest.mark.slow
def test_a_dead_worker_fails_the_next_step_loudly(tiny_checkpoint):
    engine = LLMEngine(EngineArgs(dtype="float32", model=str(tiny_checkpoint("qwen3")), tensor_parallel_size=2,
                                  num_gpu_blocks=64, max_model_len=512))
    try:
        seen = []

        def slow_listener(error):     # the step must not raise before the listeners are told
            time.sleep(0.5)
            seen.append(error)

        engine.on_dead(slow_listener)
        kill_worker_mid_request(engine, "tensor-parallel")
        assert seen == [engine.dead_error] and engine.dead_error is not None
    finally:
        engine.close()


@pytest.mark.parametrize("rank_1, error", [
    ({"free_gib": 0.5}, r"rank 1 exited with status 1 while starting: ValueError: KVPILOT_FAKE_DEVICE_MEMORY: "
                        r"weights \+ activation \+ non-torch exceed free memory"),
    ({"free_gib": 5}, r"rank 1 \(pid \d+\) exited with status 1: ValueError: free GPU memory at start-up, "
                      r"5\.00 GiB .* is less than gpu_memory_utilization=0\.9 asks for"),
], ids=["while-starting", "while-profiling"])
def test_a_worker_that_fails_at_start_up_fails_the_engine_with_its_error(monkeypatch, tiny_checkpoint,
                                                                         rank_1, error):
    """Rank 1's own (simulated) GPU is short of memory: the engine reports rank 1's error."""
    monkeypatch.setenv("KVPILOT_FAKE_DEVICE_MEMORY", json.dumps(
        {"total_gib": 8, "free_gib": 8, "weights_gib": 1, "ranks": {"1": rank_1}}))
    with pytest.raises((RuntimeError, EngineDeadError), match=error):
        LLM(str(tiny_checkpoint("qwen3")), dtype="float32", tensor_parallel_size=2, max_model_len=256)
