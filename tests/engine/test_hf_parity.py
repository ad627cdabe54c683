"""Greedy outputs are token-identical to HF transformers on the same checkpoint.

The oracle is ``AutoModelForCausalLM.generate`` (float32, CPU) on the very checkpoint the
engine loads. The engine runs the same prompts under several configurations: plain,
with prefix-cache hits, with chunked prefill under a small token budget, and with a KV
pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams

from support.hf_oracle import MAX_NEW, hf_greedy, make_prompts

KINDS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    prompts = make_prompts(512, seed=KINDS.index(request.param))
    return path, prompts, hf_greedy(path, prompts)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def run(path, prompts, **engine_kwargs):
    llm = LLM(str(path), **{"dtype": "float32", **engine_kwargs})   # transformers runs float32
    outs = llm.generate(prompts, GREEDY)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_plain_and_prefix_hits(case):
    path, prompts, expected = case
    llm, got = run(path, prompts, num_gpu_blocks=512, max_model_len=1024)
    assert got == expected
    first = llm.get_stats()
    assert first.prefix_cache_hits > 0          # the shared prefixes already hit within one batch
    # Second pass: every prompt of >= 17 tokens now hits its cached blocks.
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    second = llm.get_stats()
    assert again == expected
    hits = second.prefix_cache_hits - first.prefix_cache_hits
    assert hits >= sum((len(p) - 1) // 16 * 16 for p in prompts) * 0.9


@pytest.mark.slow
def test_chunked_prefill_small_budget(case):
    path, prompts, expected = case
    llm, got = run(path, prompts, num_gpu_blocks=512, max_model_len=1024, max_num_batched_tokens=64,
                   enable_prefix_caching=False)
    assert got == expected
    assert llm.get_stats().prefix_cache_hits == 0


@pytest.mark.slow
def test_tiny_pool_preempts_and_recomputes(case):
    path, prompts, expected = case
    llm, got = run(path, prompts, num_gpu_blocks=42, max_model_len=640, max_num_batched_tokens=256)
    assert llm.get_stats().num_preemptions > 0
    assert got == expected
    assert llm.get_stats().kv_cache_usage == 0.0
