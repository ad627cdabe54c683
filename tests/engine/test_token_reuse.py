"""Token-granular reuse through the engine: the same tokens as without it (float32 and an
fp8 KV cache, base model and LoRA adapters), more of each prompt from the cache, never
across an adapter or a cache salt, and off where a copy cannot hold (a hybrid model)."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora.config import LoRAModule

from support.lora_adapters import build_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Prompts that share a prefix and part (not all) of a block: mid-block divergences,
    exact repeats (their last partial block) and extensions of earlier prompts."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 500) for _ in range(150)]
    prompts = [base[:100], base[:100], base[:90] + [7, 8, 9] + base[93:120], base[:57],
               base[:100] + [rng.randrange(3, 500) for _ in range(30)], base[:33], base[:131]]
    other = [rng.randrange(3, 500) for _ in range(40)]
    return prompts + [other, other[:39] + [5]]


def _run(path, prompts, lora_name=None, **kwargs):
    """Each prompt on its own, in order (so that earlier ones are released and can give)."""
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=200, max_model_len=512, **kwargs)
    outs = [llm.generate([p], GREEDY, lora_name=lora_name)[0] for p in prompts]
    return llm, outs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_same_tokens_with_more_of_each_prompt_cached(tiny_checkpoint, kv_cache_dtype):
    path = tiny_checkpoint("qwen3")
    prompts = _prompts(1)
    off_llm, off = _run(path, prompts, kv_cache_dtype=kv_cache_dtype)
    on_llm, on = _run(path, prompts, kv_cache_dtype=kv_cache_dtype, token_granular_reuse=True)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    cached_off = [o.num_cached_tokens for o in off]
    cached_on = [o.num_cached_tokens for o in on]
    assert all(a >= b for a, b in zip(cached_on, cached_off, strict=True))
    # the repeat, the mid-block divergence and the extension reuse their partial blocks
    assert cached_on[1] == 99 and cached_off[1] == 96
    assert cached_on[2] == 90 and cached_off[2] == 80
    assert cached_on[-1] == 39 and cached_off[-1] == 32
    s_off, s_on = off_llm.get_stats(), on_llm.get_stats()
    saved = sum(cached_on) - sum(cached_off)
    assert s_off.computed_prompt_tokens - s_on.computed_prompt_tokens == saved > 0
    assert s_on.prefix_cache_hits - s_off.prefix_cache_hits == saved
    pool = on_llm.llm_engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_an_adapter_or_a_salt_never_reuses_another_ones_tokens(tmp_path_factory, tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    adapter = build_adapter(path, tmp_path_factory.mktemp("reuse-adapter"), 8, seed=3)
    kwargs = dict(enable_lora=True, max_loras=1, max_lora_rank=8,
                  lora_modules=(LoRAModule("a", str(adapter)),))
    prompt = _prompts(2)[0]
    outs = {}
    for reuse in (False, True):
        llm = LLM(str(path), dtype="float32", num_gpu_blocks=200, max_model_len=512,
                  token_granular_reuse=reuse, **kwargs)
        base = llm.generate([prompt], GREEDY)[0]
        under = llm.generate([prompt], GREEDY, lora_name="a")[0]        # base model's blocks only
        salted = llm.generate([prompt], GREEDY, cache_salt="t")[0]       # no salted blocks yet
        again = llm.generate([prompt], GREEDY, lora_name="a")[0]        # its own blocks now
        assert under.num_cached_tokens == salted.num_cached_tokens == 0
        assert again.num_cached_tokens == (99 if reuse else 96)
        outs[reuse] = [o.outputs[0].token_ids for o in (base, under, salted, again)]
    assert outs[True] == outs[False]
    assert outs[True][1] != outs[True][0]   # the adapter changes the answer: isolation matters


def test_off_where_a_copy_cannot_hold(tmp_path, caplog):
    """A hybrid (sliding-window + full attention) model keeps whole-block reuse only."""
    from support.gemma3_checkpoints import build_gemma3
    from support.tiny_checkpoints import save_tokenizer

    base = build_gemma3(tmp_path)
    save_tokenizer(base, 512)
    llm = LLM(str(base), dtype="float32", max_model_len=256, num_gpu_blocks=64,
              token_granular_reuse=True)
    manager = llm.llm_engine.kv_cache_manager
    assert manager.token_reuse is False and manager.take_token_copies() == []
    prompt = list(range(10, 60))
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 48
