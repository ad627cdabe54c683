"""Pipeline parallelism on CPU (gloo): PP=2 and TP=2 x PP=2, every rank a process of its own.

Oracles: HF transformers' greedy tokens (float32) on the very checkpoint, for the three head
layouts of the tensor-parallel tests (Qwen3 GQA, Qwen2 with tied embeddings: the last stage
holds its own copy of the embedding as the LM head, Llama with a single KV head). The
checkpoints have 3 layers, so the stages are uneven (vLLM's split: 2 + 1). Steps go through
the stages as two microbatches in flight (the default, one per stage), or whole (one case,
``pipeline_microbatches=1``). Each runs with a
pinned KV budget per GPU small enough to preempt, a token budget small enough to chunk
prefills, and prompts that share prefixes; the per-rank block counts are the shared KV
formula's for each stage's layers, and the group allocates their minimum.
"""

from __future__ import annotations

import pytest

from kvpilot.contract.kv_layout import KVLayout, kv_heads_per_rank
from kvpilot.contract.pipeline_stages import layer_split
from kvpilot.engine import LLM, SamplingParams

from support.hf_oracle import MAX_NEW, assert_chunked_hits_and_preempted, hf_greedy, make_prompts
from support.worker_death import kill_worker_mid_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# kind, config overrides, TP, PP, microbatches per step (None: one per stage; 1: none)
LAYOUTS = {
    "qwen3-gqa-pp2": ("qwen3", {}, 1, 2, None),
    "qwen2-tied-pp2-sync": ("qwen2", {"tie_word_embeddings": True}, 1, 2, 1),
    "llama-mqa-tp2-pp2": ("llama", {"num_key_value_heads": 1}, 2, 2, None),
    "qwen3-gqa-tp2-pp2": ("qwen3", {}, 2, 2, None),
}
NUM_LAYERS = 3
BLOCK_SIZE = 16
BUDGET_BLOCKS = 42        # of the first (largest) stage: small enough to preempt


def planned_blocks(config: dict, tp: int, pp: int, budget: int) -> list[int]:
    """Each rank's block count by the shared KV formula: its stage's layers, its KV heads."""
    head_dim = config.get("head_dim", 64 // 4)
    heads = kv_heads_per_rank(config.get("num_key_value_heads", 2), tp)
    return [KVLayout(layers, heads, head_dim, 4, BLOCK_SIZE).num_blocks(budget)
            for layers in layer_split(NUM_LAYERS, pp) for _ in range(tp)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stages_match_hf_with_chunks_prefix_hits_and_preemption(layout, tiny_checkpoint):
    kind, overrides, tp, pp, microbatches = LAYOUTS[layout]
    path = tiny_checkpoint(kind, num_hidden_layers=NUM_LAYERS, **overrides)
    prompts = make_prompts(512, seed=sorted(LAYOUTS).index(layout))
    expected = hf_greedy(path, prompts)
    config = {**overrides, **({"head_dim": 32} if kind == "qwen3" else {})}
    first = KVLayout(layer_split(NUM_LAYERS, pp)[0], kv_heads_per_rank(config.get("num_key_value_heads", 2), tp),
                     config.get("head_dim", 16), 4, BLOCK_SIZE)
    budget = first.memory_for_blocks(BUDGET_BLOCKS)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              pipeline_microbatches=microbatches, kv_cache_memory_bytes=budget, max_model_len=640, max_num_batched_tokens=64)
    try:
        engine = llm.llm_engine
        runner = engine.runner
        assert [layer.self_attn.layer_idx for layer in runner.model.layers] == [0, 1]   # stage 0: 2 of 3
        assert runner.model.norm is None and runner.model.lm_head is None              # on the last stage
        planned = planned_blocks(config, tp, pp, budget)
        assert planned[0] == BUDGET_BLOCKS and planned[-1] == 2 * BUDGET_BLOCKS        # stage 1: 1 layer
        assert engine.num_blocks_per_rank == planned
        assert runner.num_blocks_per_rank == [BUDGET_BLOCKS] * (tp * pp)                # the minimum, everywhere
        assert engine.cache_info.num_gpu_blocks == BUDGET_BLOCKS
        assert len(engine.workers.pids) == tp * pp - 1
        assert runner.num_microbatches == (microbatches or pp)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert sum(g == e for g, e in zip(got, expected, strict=True)) == len(prompts)
        stats = llm.get_stats()
        assert_chunked_hits_and_preempted(stats, prompts, 64)
        print(f"\n[{layout}] {len(prompts)}/{len(prompts)} prompts token-identical to HF; "
              f"preemptions {stats.num_preemptions}, prefix-cache hits {stats.prefix_cache_hits}, "
              f"steps {stats.num_steps}; blocks per rank {engine.num_blocks_per_rank} -> {BUDGET_BLOCKS}")
    finally:
        llm.llm_engine.close()


def test_sizes_that_cannot_split_the_layers_are_refused_before_anything_starts(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))     # 2 layers
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 must be in \[1, 2\] \(the model's layers\)"):
        LLM(path, dtype="float32", pipeline_parallel_size=3, num_gpu_blocks=64)
    with pytest.raises(ValueError, match="KV offloading is not implemented with pipeline parallelism"):
        LLM(path, dtype="float32", pipeline_parallel_size=2, num_gpu_blocks=64, kv_offloading_size=0.1)
    with pytest.raises(ValueError, match="LoRA adapters are not implemented with pipeline parallelism"):
        LLM(path, dtype="float32", pipeline_parallel_size=2, num_gpu_blocks=64, enable_lora=True)


def test_microbatches_cut_at_request_boundaries_evenly():
    from kvpilot.engine.model.parallel.microbatch import request_bounds

    assert request_bounds((64,), 2) == [(0, 1)]                          # one request: not cut
    assert request_bounds((30, 2, 1, 31), 2) == [(0, 2), (2, 4)]         # 32 + 32 tokens
    assert request_bounds((1, 1, 1, 1, 60), 2) == [(0, 4), (4, 5)]
    assert request_bounds((5, 5, 5), 3) == [(0, 1), (1, 2), (2, 3)]
    assert request_bounds((5, 5, 5), 8) == [(0, 1), (1, 2), (2, 3)]       # at most one per request


@pytest.mark.slow
def test_two_microbatches_are_in_flight_at_once(tiny_checkpoint, capfd):
    """The stages' own timings (each rank logs when it computed each microbatch, one host's
    monotonic clock): stage 1 computes microbatch 0 while stage 0 computes microbatch 1."""
    import logging
    import re

    path = str(tiny_checkpoint("llama", num_hidden_layers=2, hidden_size=256, intermediate_size=1024))
    kvpilot = logging.getLogger("kvpilot")
    level = kvpilot.level
    kvpilot.setLevel(logging.DEBUG)      # the worker inherits it (WorkerSpec.log_level)
    handler = logging.StreamHandler()
    logging.getLogger("kvpilot.engine.model.parallel.microbatch").addHandler(handler)
    try:
        llm = LLM(path, dtype="float32", pipeline_parallel_size=2, num_gpu_blocks=256, max_model_len=640,
                  max_num_batched_tokens=2048, enable_prefix_caching=False)
        try:
            prompts = [[3 + (7 * i + j) % 500 for j in range(300)] for i in range(4)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        finally:
            llm.llm_engine.close()
    finally:
        kvpilot.setLevel(level)
        logging.getLogger("kvpilot.engine.model.parallel.microbatch").removeHandler(handler)
    spans = {}
    for mb, stage, start, end in re.findall(r"microbatch (\d)/2 \(600 tokens\) on stage (\d) rank \d: "
                                            r"([\d.]+)-([\d.]+)", capfd.readouterr().err):
        spans[(int(mb), int(stage))] = (float(start), float(end))
    assert set(spans) == {(0, 0), (1, 0), (0, 1), (1, 1)}, spans      # the prefill step, 2 x 600 tokens
    (s0_mb1, e0_mb1), (s1_mb0, e1_mb0) = spans[(1, 0)], spans[(0, 1)]
    overlap = min(e0_mb1, e1_mb0) - max(s0_mb1, s1_mb0)
    print(f"\n[microbatches] stage 0 computed microbatch 1 in {e0_mb1 - s0_mb1:.3f} s, stage 1 microbatch 0 "
          f"in {e1_mb0 - s1_mb0:.3f} s; at once for {overlap:.3f} s")
    assert overlap > 0


@pytest.mark.slow
def test_a_dead_stage_fails_the_next_step_loudly(tiny_checkpoint):
    from kvpilot.engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(dtype="float32", model=str(tiny_checkpoint("qwen3")), pipeline_parallel_size=2,
                                  num_gpu_blocks=64, max_model_len=512))
    try:
        kill_worker_mid_request(engine, "pipeline-parallel")
    finally:
        engine.close()


@pytest.mark.slow
def test_each_rank_profiles_its_own_gpu_and_the_tightest_sizes_the_group(monkeypatch, tiny_checkpoint):
    """Simulated GPUs (``KVPILOT_FAKE_DEVICE_MEMORY``): stage 1's rank has a larger activation
    peak, so though it holds half the layers its budget holds fewer blocks than stage 0's;
    every rank profiles (the profile step crossing both stages) and allocates stage 1's count."""
    import json

    from kvpilot.contract.kv_layout import KVLayout

    gib = 1 << 30
    monkeypatch.setenv("KVPILOT_FAKE_DEVICE_MEMORY", json.dumps(
        {"total_gib": 0.1, "free_gib": 0.1, "weights_gib": 0.01, "ranks": {"1": {"activation_gib": 0.06}}}))
    llm = LLM(str(tiny_checkpoint("qwen3", num_hidden_layers=NUM_LAYERS)), dtype="float32",
              pipeline_parallel_size=2, max_model_len=256)
    try:
        engine = llm.llm_engine
        budget = [int(int(0.1 * gib) * 0.9) - int(0.01 * gib) - extra for extra in (0, int(0.06 * gib))]
        planned = [KVLayout(layers, 2, 32, 4, BLOCK_SIZE).num_blocks(b)
                   for layers, b in zip(layer_split(NUM_LAYERS, 2), budget, strict=True)]
        assert engine.num_blocks_per_rank == planned and planned[1] < planned[0]
        assert engine.runner.num_blocks_per_rank == [planned[1]] * 2
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        print(f"\n[profiled] blocks per rank {planned} -> {planned[1]} on every rank")
    finally:
        llm.llm_engine.close()
