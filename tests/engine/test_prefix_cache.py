"""Prefix caching through the engine: a shared 1,500-token prefix, and cache_salt isolation."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    path = tiny_checkpoint("qwen3", max_position_embeddings=2048)
    return LLM(str(path), dtype="float32", num_gpu_blocks=400, max_model_len=2048)


def prompts(seed: int, prefix_len: int = 1500):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    return prefix + [rng.randrange(3, 512) for _ in range(37)], prefix + [rng.randrange(3, 512) for _ in range(61)]


def test_second_request_hits_the_shared_prefix(llm):
    first, second = prompts(1)
    llm.generate([first], GREEDY)
    before = llm.get_stats()
    out = llm.generate([second], GREEDY)[0]
    after = llm.get_stats()
    hit = after.prefix_cache_hits - before.prefix_cache_hits
    computed = after.computed_prompt_tokens - before.computed_prompt_tokens
    assert hit >= 0.9 * 1500
    assert hit == 1500 // 16 * 16                      # every full block of the prefix
    assert out.num_cached_tokens == hit
    assert computed == len(second) - hit                # only the remainder went through the model
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)


def test_cache_salt_isolates_tenants(llm):
    first, second = prompts(2)
    llm.generate([first], GREEDY, cache_salt="tenant-a")
    before = llm.get_stats()
    other = llm.generate([second], GREEDY, cache_salt="tenant-b")[0]
    mid = llm.get_stats()
    same = llm.generate([second], GREEDY, cache_salt="tenant-a")[0]
    after = llm.get_stats()
    assert mid.prefix_cache_hits == before.prefix_cache_hits and other.num_cached_tokens == 0
    assert mid.computed_prompt_tokens - before.computed_prompt_tokens == len(second)
    assert after.prefix_cache_hits - mid.prefix_cache_hits >= 0.9 * 1500
    assert same.outputs[0].token_ids == other.outputs[0].token_ids   # same KV either way


def test_prefix_caching_off_never_hits(tiny_checkpoint):
    path = tiny_checkpoint("qwen3", max_position_embeddings=2048)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=400, max_model_len=2048, enable_prefix_caching=False)
    first, second = prompts(3, prefix_len=200)
    llm.generate([first, second], GREEDY)
    llm.generate([second], GREEDY)
    stats = llm.get_stats()
    assert stats.prefix_cache_hits == 0
    assert stats.computed_prompt_tokens == len(first) + 2 * len(second)
