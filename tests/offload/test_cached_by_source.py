"""The offload tiers in the prefix-cache figures: ``vllm:prompt_tokens_cached_by_source``
(device, host, disk; they sum to the cached tokens) and the ``evicted_offload_full`` miss
reason when a full CPU tier dropped the prefix the device had evicted."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM

from support.offload_helpers import ENGINE_KW, GREEDY, PREFIX_BLOCK_TOKENS, delta, run_measured

pytestmark = pytest.mark.slow
GIB = 1 << 30
SOURCES = ("prompt_tokens_local_cache_hit", "prompt_tokens_cached_host", "prompt_tokens_cached_disk")


def _evict_prefix(llm: LLM, prompts) -> None:
    llm.generate([prompts.first], GREEDY)
    llm.generate([prompts.filler], GREEDY)


def test_cached_tokens_by_source_sum_to_the_cached_tokens(offload_model, prompts, tmp_path):
    tiny_cpu = 4 * 32 * 1024 / GIB        # 4 blocks: most of the prefix comes from disk
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_size=tiny_cpu,
              kv_offloading_disk_path=str(tmp_path / "kv"), kv_offloading_disk_size=0.1)
    _evict_prefix(llm, prompts)
    llm.llm_engine.kv_offload.flush()
    _, before, after = run_measured(llm, prompts.second)
    by_source = {name: delta(after, before, name) for name in SOURCES}
    assert sum(by_source.values()) == delta(after, before, "prompt_tokens_cached") == PREFIX_BLOCK_TOKENS
    assert by_source["prompt_tokens_cached_disk"] > 0 and by_source["prompt_tokens_cached_host"] >= 0
    assert (by_source["prompt_tokens_cached_host"] + by_source["prompt_tokens_cached_disk"]
            == delta(after, before, "prompt_tokens_external_kv_transfer"))
    assert after.prompt_tokens_cached_external_unspecified is None   # native tiers only
    llm.llm_engine.close()


def test_a_full_cpu_tier_is_the_reason_of_the_miss(offload_model, prompts):
    tiny_cpu = 4 * 32 * 1024 / GIB        # far too small for the prefix: it drops most of it
    llm = LLM(offload_model, **ENGINE_KW, kv_offloading_size=tiny_cpu)
    _evict_prefix(llm, prompts)
    out = llm.generate([prompts.second], GREEDY)[0]
    miss = out.prefix_miss
    assert miss is not None and miss.reason == "evicted_offload_full", miss
    assert miss.num_tokens == len(prompts.second) - out.num_cached_tokens
    assert llm.get_stats().prefix_miss_evicted_offload_full == miss.num_tokens
    llm.llm_engine.close()
