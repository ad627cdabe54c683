"""The engine-side figures behind the new metrics: sampled KV block residency through a real
block pool, prompt-token sources through the real scheduler, the MFU cost model against
the parameter count of the same model built by HF transformers."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.contract.step_cost import StepCostModel
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_residency import KVResidencySampler
from kvpilot.engine.core.request import Request
from kvpilot.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _lives(events):
    return sorted((e.lifetime_seconds, e.idle_seconds) for e in events if e.reuse_gap_seconds is None)


def test_residency_follows_a_block_from_allocation_through_hits_to_eviction():
    clock = Clock()
    sampler = KVResidencySampler(1.0, clock=clock)
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=True,
                        hash_root=root_hash(None, "t"), residency=sampler)
    prompt = [1, 2, 3, 4, 5]                     # one full block + one token
    first = _request("a", prompt)
    assert kv.allocate_slots(first, 5, kv.find_prefix_hit(first))   # t=100: both blocks allocated
    first.num_computed_tokens = 5
    clock.now = 103.0
    kv.free(first)                                # released at 103
    clock.now = 110.0
    again = _request("b", prompt)
    hit = kv.find_prefix_hit(again)
    assert len(hit.blocks) == 1
    # the hit revives block 0: a 10 s reuse gap; the partial block 1 is handed out again:
    # its life (100 -> 110, idle since its release at 103) ends
    assert kv.allocate_slots(again, 1, hit)
    events = sampler.drain()
    assert [e.reuse_gap_seconds for e in events if e.reuse_gap_seconds is not None] == [10.0]
    assert _lives(events) == [(10.0, 7.0)]
    again.num_computed_tokens = 5
    clock.now = 111.0
    kv.free(again)
    clock.now = 120.0
    other = _request("c", [9, 9, 9, 9, 9, 9, 9, 9])   # needs both blocks: evicts block 0 too
    assert kv.allocate_slots(other, 8, kv.find_prefix_hit(other))
    assert _lives(sampler.drain()) == [(10.0, 9.0), (20.0, 9.0)]
    assert sampler.drain() == []


def test_residency_sampling_rate():
    clock = Clock()
    sampler = KVResidencySampler(0.25, seed=3, clock=clock)
    for block_id in range(4000):
        sampler.on_allocate(block_id)
    for block_id in range(4000):
        sampler.on_hit(block_id)      # reported only for the followed blocks
    gaps = [e for e in sampler.drain() if e.reuse_gap_seconds is not None]
    assert 800 < len(gaps) < 1200     # about a quarter
    with pytest.raises(ValueError, match="sample rate"):
        KVResidencySampler(0.0)


def test_prompt_token_sources_split_computed_hits_and_recompute():
    from kvpilot.engine.config import SchedulerConfig
    from kvpilot.engine.core.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, hash_root=root_hash(None, "t"))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    prompt = list(range(1, 9))                     # 8 tokens = 2 full blocks
    for rid in ("a", "b"):
        scheduler.add_request(_request(rid, prompt))
        out = scheduler.schedule()
        scheduler.update_from_output(out, {rid: [1]})
    sources = scheduler.prompt_token_sources
    # a: all 8 computed; b: block 0 hit, block 1 cached but recomputed (the last token must run)
    assert (sources.local_compute, sources.local_cache_hit, sources.recomputed) == (12, 4, 4)


def test_cost_model_counts_the_weights_hf_transformers_builds():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    # linear weights of the layers + embedding + LM head (norms are vectors, not matmuls)
    hf_matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
    cost = StepCostModel(num_layers=3, hidden_size=64, intermediate_size=128, num_heads=4,
                          num_kv_heads=2, head_dim=32, vocab_size=512, weight_bytes=2,
                          kv_bytes_per_token=3 * 2 * 2 * 32 * 2)
    assert cost.num_weights == hf_matrices
    decode = cost.step([(1, 10)])
    layer_linear = hf_matrices - 2 * 512 * 64
    assert decode.flops == 2 * layer_linear + 2 * 512 * 64 + 4 * 3 * 4 * 32 * 10
    assert decode.read_bytes == hf_matrices * 2 + 10 * cost.kv_bytes_per_token
    assert decode.write_bytes == cost.kv_bytes_per_token
    assert dataclasses.replace(cost, tensor_parallel_size=2).step([(1, 10)]).flops == decode.flops // 2


def test_requests_with_nan_logits_are_counted_once_each_when_checked():
    import torch

    from kvpilot.engine.llm import LLM

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    healthy = LLM("demo", dtype="float32", num_gpu_blocks=16, max_model_len=64, compute_nans_in_logits=True)
    healthy.generate(prompts, params)
    assert healthy.get_stats().num_corrupted_reqs == 0
    broken = LLM("demo", dtype="float32", num_gpu_blocks=16, max_model_len=64, compute_nans_in_logits=True)
    model = broken.llm_engine.runner.model
    with torch.no_grad():   # one NaN in the final norm: every position's logits turn NaN
        dict(model.named_parameters())[[n for n, _ in model.named_parameters() if "norm" in n][-1]][0] = \
            float("nan")
    broken.generate(prompts, params)
    assert broken.get_stats().num_corrupted_reqs == len(prompts)   # 3 steps each, counted once
