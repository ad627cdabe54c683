"""Greedy outputs under LoRA adapters are token-identical to transformers + PEFT.

Each tiny base model (Llama, Qwen2, Qwen3, and Gemma 3 with its sliding-window layers) gets three random PEFT adapters (ranks 8 and
16, one with rsLoRA scaling and attention-only targets; all B non-zero). Every prompt is
sent under each adapter and under the base model, all in one batch, so steps mix rows of
different adapters with base rows; the oracle runs each adapter alone through PEFT. The
engine runs plain with a second pass of prefix hits, with chunked prefill under a small
token budget, and with a KV pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora.config import LoRAModule

from support.lora_adapters import peft_greedy

KINDS = ["llama", "qwen2", "qwen3", "gemma3"]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    shared = rand(70)
    return [rand(5), rand(33), rand(120), shared + rand(9), shared + rand(30)]


@pytest.fixture(scope="module", params=KINDS)
def case(request, lora_case):
    base, adapters = lora_case(request.param)
    prompts = _prompts(KINDS.index(request.param))
    expected = {None: peft_greedy(base, None, prompts, MAX_NEW)}
    for name, path in adapters.items():
        expected[name] = peft_greedy(base, path, prompts, MAX_NEW)
    return base, adapters, prompts, expected


def _serve(base, adapters, prompts, **engine_kwargs):
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()), **engine_kwargs)
    return llm, _generate(llm, adapters, prompts)


def test_adapters_change_the_outputs(case):
    """The oracle itself: every adapter changes some continuation (else parity proves nothing)."""
    _, adapters, _, expected = case
    for name in adapters:
        assert expected[name] != expected[None], name


@pytest.mark.slow
def test_mixed_batch_plain_and_prefix_hits(case):
    base, adapters, prompts, expected = case
    llm, got = _serve(base, adapters, prompts, num_gpu_blocks=256, max_model_len=512)
    assert got == expected
    first = llm.get_stats()
    assert first.prefix_cache_hits > 0        # shared prefixes hit within one adapter
    again = _generate(llm, adapters, prompts)
    assert again == expected
    assert llm.get_stats().prefix_cache_hits > first.prefix_cache_hits


def _generate(llm, adapters, prompts):
    """Every prompt under every adapter and the base model, interleaved in one batch."""
    names = [None, *adapters]
    batch = [(name, p) for p in prompts for name in names]
    outs = llm.generate([p for _, p in batch], GREEDY, lora_name=[n for n, _ in batch])
    got: dict = {name: [] for name in names}
    for (name, _), out in zip(batch, outs, strict=True):
        got[name].append(out.outputs[0].token_ids)
    return got


@pytest.mark.slow
def test_mixed_batch_chunked_prefill(case):
    base, adapters, prompts, expected = case
    _, got = _serve(base, adapters, prompts, num_gpu_blocks=256, max_model_len=512,
                    max_num_batched_tokens=32, enable_prefix_caching=False)
    assert got == expected


@pytest.mark.slow
def test_mixed_batch_preemption(case):
    base, adapters, prompts, expected = case
    # (Gemma 3's one global layer in 24 blocks is not tight enough to preempt: fewer)
    blocks = 12 if base.name.startswith("lora-base-gemma3") else 24
    llm, got = _serve(base, adapters, prompts, num_gpu_blocks=blocks, max_model_len=160,
                      max_num_batched_tokens=128)
    assert llm.get_stats().num_preemptions > 0
    assert got == expected


@pytest.mark.slow
def test_fewer_slots_than_adapters(case):
    """One device slot for three adapters: adapters take turns (never two in a step) and
    every output is still the oracle's."""
    base, adapters, prompts, expected = case
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16,
              lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()),
              num_gpu_blocks=256, max_model_len=512)
    got = _generate(llm, adapters, prompts)
    assert got == expected
    registry = llm.llm_engine.lora
    assert registry.num_slot_loads >= len(adapters)
    assert registry.num_reads > len(adapters)   # host LRU of 2: one adapter read again
