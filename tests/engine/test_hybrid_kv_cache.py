"""Hybrid KV cache: a Qwen2 with a full-attention layer and a sliding-window layer keeps
each kind in its own pool with its own block tables; the windowed pool releases the
blocks outside the window.

Oracles: HF transformers float32 greedy tokens (a small windowed pool forces its released
blocks to be handed out again, so a layer reading the wrong table or a released block
would change the tokens); the planner's plan for the same bytes (its block count and
concurrency, run by the engine without a preemption); and, for the measured figures,
the window arithmetic (at most ``window + block_size`` tokens held on the windowed layer).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvpilot.contract.kv_layout import blocks_held, sliding_pool_blocks
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvpilot.engine.core.request import Request

from support.hf_oracle import hf_greedy
from support.hybrid_plan import plan_and_engine, run_at_once
from support.one_request import steps_of_one_request

WINDOW, BLOCK = 32, 16
MIXED = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\n{text}")


def _prompts(seed: int, lengths: tuple[int, ...], shared_len: int, shared_tails: tuple[int, ...]):
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    shared = rand(shared_len)
    return [rand(n) for n in lengths] + [shared + rand(n) for n in shared_tails]


def _generate(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.slow
def test_small_windowed_pool_matches_hf_with_chunks_hits_and_preemption(tiny_checkpoint, capsys):
    """Torch backend: 2 sequences at a time, 24-token chunks, a 14-block full pool (so the
    150-token prompt preempts its neighbour) and a 10-block windowed pool (sequences span
    up to 10 blocks each, so the windowed blocks are released and handed out again); a
    second pass takes prefix hits whose early windowed blocks were evicted."""
    path = tiny_checkpoint("qwen2", **MIXED)
    prompts = _prompts(1, (20, 33, 64, 150), 70, (5, 40))
    expected = hf_greedy(path, prompts)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=14, max_model_len=160, max_num_seqs=2, max_num_batched_tokens=24)
    kv = llm.llm_engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    num_sliding = kv.sliding.pool.num_blocks
    assert num_sliding == sliding_pool_blocks(2, 24, 160, BLOCK, WINDOW) == 10
    assert _generate(llm, prompts, 8) == expected
    first = llm.get_stats()
    assert first.num_preemptions > 0
    assert _generate(llm, prompts, 8) == expected
    stats = llm.get_stats()
    hits = stats.prefix_cache_hits - first.prefix_cache_hits
    assert hits >= 4 * BLOCK
    assert stats.kv_cache_usage == 0.0
    assert all(g.pool.num_free_blocks == g.pool.num_blocks for g in kv.groups)
    _report(capsys, f"A1 hybrid qwen2 (layer 0 full, layer 1 window {WINDOW}), torch: {len(prompts)} prompts "
                    f"of {min(map(len, prompts))}-{max(map(len, prompts))} tokens == HF float32, chunks of 24, "
                    f"full pool 14 blocks ({first.num_preemptions} preemptions), windowed pool "
                    f"{num_sliding} blocks; second pass {hits} prefix-hit tokens, same tokens")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter")
def test_triton_backend_hybrid_with_preemption(tiny_checkpoint, capsys):
    """Triton kernels (the interpreter on CPU): 16-token chunks, a 10-block full pool that
    two sequences overflow (a preemption) and a 9-block windowed pool (smaller than the
    full one, so a layer reading the other group's table would not give HF's tokens)."""
    path = tiny_checkpoint("qwen2", **MIXED)
    prompts = _prompts(3, (112,), 40, (9, 30))
    expected = hf_greedy(path, prompts, max_new=4)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", num_gpu_blocks=10, max_model_len=160, max_num_seqs=2,
              max_num_batched_tokens=16)
    kv = llm.llm_engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager) and kv.sliding.pool.num_blocks == 9
    assert _generate(llm, prompts, 4) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    _report(capsys, f"A1 hybrid qwen2, Triton backend: prompts of {', '.join(str(len(p)) for p in prompts)} "
                    f"tokens == HF, chunks of 16, full pool 10 blocks ({stats.num_preemptions} preemptions), "
                    f"windowed pool 9 blocks, {stats.prefix_cache_hits} prefix-hit tokens")


def test_windowed_layers_hold_at_most_window_plus_one_block(tiny_checkpoint, capsys):
    """A2: a 260-token sequence: the windowed group never holds more than window +
    block_size tokens while decoding (window - 1 + a chunk while prefilling); the
    full-attention group holds every token."""
    path = tiny_checkpoint("qwen2", **MIXED)
    chunk = 32
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=512, max_num_batched_tokens=chunk)
    kv = llm.llm_engine.kv_cache_manager
    prefill_peak = decode_peak = full_peak = 0
    for request in steps_of_one_request(llm, 200, 60):
        sliding = kv.sliding.num_held_blocks("long")
        full = kv.full.num_held_blocks("long")
        # the only request: what it holds is what the pools have handed out
        assert sliding == kv.sliding.pool.num_blocks - kv.sliding.pool.num_free_blocks
        assert full == kv.full.pool.num_blocks - kv.full.pool.num_free_blocks
        assert full == -(-request.num_computed_tokens // BLOCK)
        full_peak = max(full_peak, full)
        if request.num_output_tokens <= 1:
            prefill_peak = max(prefill_peak, sliding)
        else:
            decode_peak = max(decode_peak, sliding)
    total = 200 + 60
    assert decode_peak * BLOCK <= WINDOW + BLOCK
    assert decode_peak == blocks_held(total, BLOCK, WINDOW)
    assert prefill_peak <= blocks_held(total, BLOCK, WINDOW - 1 + chunk)
    assert full_peak == -(-(total - 1) // BLOCK)
    _report(capsys, f"A2 hybrid qwen2 window {WINDOW}, block {BLOCK}, {total}-token sequence: windowed layer "
                    f"holds {decode_peak} blocks = {decode_peak * BLOCK} tokens while decoding (window + "
                    f"block = {WINDOW + BLOCK}), {prefill_peak} blocks while prefilling in chunks of {chunk}; "
                    f"full-attention layer holds {full_peak} blocks = {full_peak * BLOCK} tokens (all)")


@pytest.mark.slow
def test_planner_capacity_matches_the_engine(tiny_checkpoint, capsys):
    """A2: for a pinned KV byte budget the plan names the engine's full-pool block count,
    token capacity and windowed pool, and its KV-capacity concurrency (all sequences at
    the p95 length at once) runs without a preemption."""
    path = tiny_checkpoint("qwen2", **MIXED)
    plan, llm = plan_and_engine(path, 24 * 16 * 1024, BLOCK, 40, 60)
    assert plan.num_sliding_pool_layers == 1 and plan.sliding_window == WINDOW
    engine = llm.llm_engine
    info, kv = engine.cache_info, engine.kv_cache_manager
    # one pool for both layers (a block table for all) would hold fewer tokens, and fewer
    # sequences: one of 128 tokens (8 blocks) and the rest at 100 tokens (7 blocks)
    one_table = plan.kv_cache_memory_bytes // (BLOCK * plan.kv_bytes_per_token) * BLOCK
    assert plan.kv_token_capacity > one_table
    one_table_seqs = (one_table // BLOCK - 8) // 7 + 1
    assert plan.max_num_seqs > one_table_seqs
    assert run_at_once(llm, plan.max_num_seqs, 40, 60) == plan.max_num_seqs
    assert engine.scheduler.num_preemptions == 0
    _report(capsys, f"A2 planner vs engine (hybrid qwen2, {plan.kv_cache_memory_bytes:,} B of KV): plan "
                    f"{plan.num_gpu_blocks} full-pool blocks = {plan.kv_token_capacity} tokens + "
                    f"{plan.sliding_pool_blocks} windowed-pool blocks; engine {info.num_gpu_blocks} blocks = "
                    f"{info.token_capacity} tokens + {kv.sliding.pool.num_blocks}; one shared table would "
                    f"hold {one_table} tokens ({one_table_seqs} sequences); plan max_num_seqs {plan.max_num_seqs} "
                    f"ran at once, 0 preemptions")


def test_offload_is_refused_for_a_hybrid_model(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen2", **MIXED))
    with pytest.raises(ValueError, match="sliding-window models"):
        LLM(path, dtype="float32", num_gpu_blocks=64, max_model_len=256, kv_offloading_size=0.01)


def _computed(kv: HybridKVCacheManager, request: Request, chunk: int) -> None:
    """Prefill ``request`` in chunks, as the scheduler does (allocate, compute, release)."""
    kv.update_block_hashes(request)
    while request.num_computed_tokens < request.num_tokens:
        step = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, step)
        request.num_computed_tokens += step
        kv.release_outside_window(request)


def test_a_hit_needs_only_the_windowed_blocks_of_the_last_window():
    """The windowed pool evicts the early blocks of a finished prompt; a later request with
    the same prefix still hits it whole (the full group has every block, the windowed
    group the last window), and its windowed table holds placeholders before the window."""
    params = SamplingParams(max_tokens=1)
    kv = HybridKVCacheManager(32, 6, 4, enable_caching=True, hash_root=root_hash("t"), sliding_window=8)
    prompt = list(range(100, 141))                          # 41 tokens: 10 full blocks + 1
    first = Request("a", prompt, params)
    _computed(kv, first, 4)
    assert kv.sliding.num_held_blocks("a") <= blocks_held(41, 4, 8)
    kv.free(first)
    other = Request("b", list(range(300, 309)), params)     # takes 3 windowed blocks: evicts
    _computed(kv, other, 4)                                 # the oldest (the prompt's first)
    kv.free(other)
    second = Request("c", prompt + [7, 8, 9], params)
    hit = kv.find_prefix_hit(second)
    assert hit.num_tokens == 40                             # all 10 full blocks
    sliding_hit = hit.group_hits[1]
    skip = (40 - 8 + 1) // 4                                # blocks before the next query's window
    assert all(b is kv.sliding._placeholder for b in sliding_hit.blocks[:skip])
    assert all(b.block_hash == h for b, h in zip(sliding_hit.blocks[skip:], second.block_hashes[skip:10],
                                                   strict=True))
    assert kv.can_allocate(second, 4, hit) and kv.allocate_slots(second, 4, hit)
    second.num_computed_tokens = 40
    assert kv.sliding.num_held_blocks("c") == 11 - skip and kv.full.num_held_blocks("c") == 11
    kv.free(second)
    assert all(g.pool.num_free_blocks == g.pool.num_blocks for g in kv.groups)
    # with the windowed blocks of that window gone, the hit shrinks to what both groups serve
    for block in sliding_hit.blocks[skip:]:
        kv.sliding.pool.uncache(block)
    assert kv.find_prefix_hit(Request("d", prompt + [7], params)).num_tokens < 40


def test_padded_decode_path_reads_each_groups_buffers(tiny_checkpoint):
    """CUDA-graph inputs of a hybrid model: decode batches padded to a captured size give
    HF's tokens, and the static metadata a captured graph replays gives each layer its own
    group's slot mapping and block table (the same values the step built). On CPU the
    padded forward runs eagerly; the capture itself needs CUDA."""
    from kvpilot.engine.model.cuda_graphs import DecodeGraphs, capture_sizes

    path = tiny_checkpoint("qwen2", **MIXED)
    prompts = _prompts(7, (40, 70, 90), 0, ())
    expected = hf_greedy(path, prompts, max_new=6)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=24, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    assert llm.llm_engine.kv_cache_manager.sliding.pool.num_blocks == 10
    graphs = DecodeGraphs(runner.model, runner.inputs, runner.kv_caches, runner.backend, capture_sizes(2),
                          128, runner.layer_kv_groups)
    runner.graphs = graphs
    real_run, differing = graphs.run, []

    def run(step, size):
        static, groups = graphs._static_metadata(size), step.kv_group_metadata
        for meta, group in zip(static, runner.layer_kv_groups, strict=True):
            assert torch.equal(meta.block_tables, groups[group].block_tables)
            assert torch.equal(meta.slot_mapping, groups[group].slot_mapping)
        differing.append(not torch.equal(static[0].block_tables, static[1].block_tables))
        return real_run(step, size)

    graphs.run = run
    assert _generate(llm, prompts, 6) == expected
    assert differing and any(differing)
