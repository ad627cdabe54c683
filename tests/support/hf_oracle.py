"""The HF transformers oracle of the parity tests: greedy continuations of token prompts.

Shared by the one-rank and the tensor-parallel parity tests.
"""

from __future__ import annotations

import random

import torch

MAX_NEW = 8


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16+ prompts, lengths 1..600, several sharing long prefixes."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731  (ids < 3 are special)
    shared_a, shared_b = rand(400), rand(150)
    prompts = [rand(n) for n in (1, 2, 7, 16, 17, 33, 100, 257, 600)]
    prompts += [shared_a + rand(n) for n in (1, 16, 50, 200)]        # 401..600 tokens
    prompts += [shared_b + rand(n) for n in (3, 40)]
    prompts += [shared_a[:64], shared_b + shared_a[:20]]
    assert len(prompts) >= 16 and min(map(len, prompts)) == 1 and max(map(len, prompts)) == 600
    return prompts


def hf_greedy(path, prompts: list[list[int]], max_new: int = MAX_NEW,
              gguf_file: str | None = None) -> list[list[int]]:
    """transformers' greedy continuations (float32) of ``prompts`` on the checkpoint in
    ``path``. ``gguf_file``: the GGUF file in that directory, through transformers' GGUF
    loader; then EOS is an ordinary token, as under the engine's ``ignore_eos`` (``generate``
    would ban it until ``max_new`` tokens), by argmax over full forward passes."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            if gguf_file:
                outs.append(_argmax_continuation(model, p, max_new))
                continue
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _argmax_continuation(model, prompt: list[int], max_new: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    new = []
    for _ in range(max_new):
        new.append(int(out.logits[0, -1].argmax()))
        past = {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}
        out = model(torch.tensor([new[-1:]]), use_cache=True, **past)   # transformers 5 / 4
    return new


def assert_chunked_hits_and_preempted(stats, prompts: list[list[int]], token_budget: int) -> None:
    """An engine's counters after ``prompts`` ran to the end: preemptions and prefix-cache
    hits happened, prefills were chunked (``token_budget`` per step), the cache is empty."""
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_steps > sum(map(len, prompts)) // token_budget // 2
    assert stats.kv_cache_usage == 0.0
