"""Throughput with four adapters in every batch against the base model alone, side by
side in one run, on one engine (and the base model on an engine without LoRA): the same
32 requests, greedy, outputs checked against each other's counts. Prints the figures;
asserts only that the LoRA batch keeps a sane fraction of the base throughput (timings on
a shared CPU vary)."""

from __future__ import annotations

import os
import time

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora.config import LoRAModule

from support.lora_adapters import build_adapter
from support.tiny_checkpoints import build_checkpoint

pytestmark = pytest.mark.slow

NUM_REQUESTS, PROMPT_LEN, MAX_NEW, ROUNDS = 32, 32, 16, 3


def _run(llm, prompts, lora_names) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_name=lora_names)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    return NUM_REQUESTS * MAX_NEW / elapsed


def test_four_adapters_in_a_batch_vs_the_base_model(tmp_path):
    base = build_checkpoint(tmp_path / "base", "qwen3", hidden_size=256, intermediate_size=512,
                            num_hidden_layers=4, head_dim=64)
    names = ["a", "b", "c", "d"]
    adapters = {n: build_adapter(base, tmp_path / n, 16 if i % 2 else 8, seed=i)
                for i, n in enumerate(names)}
    prompts = [[(7 * i + j) % 500 + 3 for j in range(PROMPT_LEN)] for i in range(NUM_REQUESTS)]
    kwargs = dict(num_gpu_blocks=1024, max_model_len=256, max_num_seqs=NUM_REQUESTS,
                  enable_prefix_caching=False)
    plain = LLM(str(base), **kwargs)
    lora = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16,
               lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()), **kwargs)
    for llm, loras in ((plain, None), (lora, None), (lora, names * (NUM_REQUESTS // 4))):
        _run(llm, prompts[:8], loras[:8] if loras else None)    # warm-up
    best = [0.0, 0.0, 0.0]
    for _ in range(ROUNDS):   # interleaved, best of each: the machine's other load varies
        for i, (llm, loras) in enumerate(((plain, None), (lora, None), (lora, names * (NUM_REQUESTS // 4)))):
            best[i] = max(best[i], _run(llm, prompts, loras))
    base_plain, base_lora_engine, mixed = best
    load = os.getloadavg()[0]
    print(f"\n{NUM_REQUESTS} requests x {MAX_NEW} tokens (prompt {PROMPT_LEN}), load {load:.1f}: "
          f"base model, LoRA off {base_plain:.0f} tok/s | base model, LoRA on {base_lora_engine:.0f} "
          f"tok/s | 4 adapters in every batch {mixed:.0f} tok/s ({mixed / base_plain:.0%} of base; "
          f"best of {ROUNDS} interleaved rounds)")
    # alone here 50-60 %; beside `make test`'s other worker one CI run saw 18 % (OpenMP threads
    # of two processes on two cores). The bar catches a pathological path (a Python loop per
    # request or per adapter, 10x and worse), not a regression of a few percent: that is the
    # benchmarks' job.
    assert mixed > 0.1 * base_plain
