"""Gemma 3 (text) gives HF transformers' ``Gemma3ForCausalLM`` tokens (greedy, float32).

The checkpoints are tiny and random (``gemma3_checkpoints``): 6 layers, 5 local with a
32-token window to 1 global, head_dim 256, 2 query heads on 1 KV head,
``query_pre_attn_scalar`` 96, separate local and global rope bases, tied embeddings and
random norm weights. Prompts run past the window (up to 150 tokens), so the local
layers' KV lives in the hybrid cache's windowed pool and its released blocks are handed
out again. Each backend runs plain, with prefix hits, with chunked prefill and with a
pool small enough to preempt; the Triton kernels run a shorter case (the interpreter on
CPU). The hub's config layout (4.x, with linear rope scaling on the global layers) is
read against HF loading the same file; final-logit soft-capping is checked on the
logprobs (a cap never changes the greedy token); the planner sizes the two pools as
the engine does.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch

from kvpilot.contract.kv_layout import sliding_pool_blocks
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager

from support.gemma3_checkpoints import WINDOW, as_4x_layout, build_gemma3
from support.hf_oracle import hf_greedy
from support.hybrid_plan import plan_and_engine, run_at_once

BLOCK = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tiny_checkpoint):
    """``gemma3(layout="5.x" | "4.x", rope_scaling=None, **config) -> Path``, cached; the
    tokenizer is the shared tiny checkpoints' (the engine needs one; ids are given)."""
    cache = {}

    def make(layout: str = "5.x", rope_scaling: dict | None = None, **overrides):
        key = (layout, json.dumps(rope_scaling), json.dumps(overrides, sort_keys=True))
        if key not in cache:
            path = build_gemma3(tmp_path_factory.mktemp("gemma3"), **overrides)
            if layout == "4.x":
                as_4x_layout(path, rope_scaling)
            for name in TOKENIZER_FILES:
                if (tiny_checkpoint() / name).is_file():
                    shutil.copy(tiny_checkpoint() / name, path / name)
            cache[key] = path
        return cache[key]

    return make


def _prompts(seed: int, lengths=(1, 20, 33, 64, 150), shared_len=70, tails=(5, 40)):
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    shared = rand(shared_len)
    return [rand(n) for n in lengths] + [shared + rand(n) for n in tails]


def _generate(llm: LLM, prompts, max_tokens: int = 8, **params) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _report(capsys, text: str) -> None:
    with capsys.disabled():
        print(f"\nA3 gemma3 {text}")


@pytest.fixture(scope="module")
def case(gemma3):
    path = gemma3()
    prompts = _prompts(1)
    return path, prompts, hf_greedy(path, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_plain_and_prefix_hits(case, backend, capsys):
    path, prompts, expected = case
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_gpu_blocks=128, max_model_len=256)
    kv = llm.llm_engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert llm.llm_engine.runner.layer_kv_groups == (1, 1, 1, 1, 1, 0)
    assert _generate(llm, prompts) == expected
    first = llm.get_stats().prefix_cache_hits
    assert _generate(llm, prompts) == expected
    hits = llm.get_stats().prefix_cache_hits - first
    assert hits >= sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    _report(capsys, f"{backend}: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
                    f"tokens (window {WINDOW}) == HF float32; second pass {hits} prefix-hit tokens")


@pytest.mark.slow
def test_chunks_small_pools_and_preemption(case, capsys):
    """The default backend (decode rows on the CPU kernel where it builds): 2 sequences
    at a time, 24-token chunks, a 14-block full pool (the 150-token prompt preempts its
    neighbour) and a 10-block windowed pool (released blocks reused)."""
    path, prompts, expected = case
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=14, max_model_len=160, max_num_seqs=2,
              max_num_batched_tokens=24)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.sliding.pool.num_blocks == sliding_pool_blocks(2, 24, 160, BLOCK, WINDOW) == 10
    assert _generate(llm, prompts) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert _generate(llm, prompts) == expected
    hits = llm.get_stats().prefix_cache_hits - stats.prefix_cache_hits
    assert hits > 0 and llm.get_stats().kv_cache_usage == 0.0
    _report(capsys, f"{llm.llm_engine.runner.backend.name}: chunks of 24, full pool 14 blocks "
                    f"({stats.num_preemptions} preemptions), windowed pool 10 blocks == HF; again with "
                    f"{hits} prefix-hit tokens == HF")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter")
def test_triton_backend(gemma3, capsys):
    """Triton kernels (attention, KV store, rotary): prompts past the window, 16-token
    chunks, a pool two sequences overflow, and prefix hits."""
    path = gemma3()
    prompts = _prompts(3, lengths=(70,), shared_len=40, tails=(9, 30))
    expected = hf_greedy(path, prompts, max_new=4)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", num_gpu_blocks=8, max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=16)
    assert _generate(llm, prompts, 4) == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    _report(capsys, f"triton: prompts of {', '.join(str(len(p)) for p in prompts)} tokens == HF, "
                    f"{stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-hit tokens")


@pytest.mark.slow
def test_two_tensor_parallel_ranks(case, capsys):
    """Two ranks (gloo): one query head each, the single KV head replicated, the tied
    vocabulary split (the soft-capped logits gathered), both KV pools on every rank."""
    path, prompts, expected = case
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_gpu_blocks=14, max_model_len=160, max_num_seqs=2,
              max_num_batched_tokens=24)
    try:
        runner = llm.llm_engine.runner
        attn = runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert _generate(llm, prompts) == expected
        assert llm.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.close()
    _report(capsys, "2 tensor-parallel ranks, chunks of 24, a 14-block full pool (preemptions) == HF")


@pytest.mark.slow
def test_hub_config_layout_with_global_rope_scaling(gemma3, capsys):
    """config.json as the hub's checkpoints have it (``sliding_window_pattern``,
    ``rope_local_base_freq``, ``rope_scaling`` on the global layers only), read by HF
    and the engine from the same file; without the scaling HF answers otherwise."""
    scaling = {"rope_type": "linear", "factor": 8.0}
    path = gemma3("4.x", scaling, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    prompts = _prompts(5, lengths=(40, 150), tails=(30,))
    expected = hf_greedy(path, prompts)
    assert hf_greedy(gemma3("4.x", None, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}), prompts) != expected
    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    arch = llm.llm_engine.model_config.arch
    assert (arch.rope.rope_type, arch.rope.factor, arch.rope.theta) == ("linear", 8.0, 10_000.0)
    assert (arch.sliding_rope.rope_type, arch.sliding_rope.theta) == ("default", 100.0)
    assert _generate(llm, prompts) == expected
    _report(capsys, "4.x config layout (pattern 6, local base 100, global base 1e4 x linear 8) == HF")


@pytest.mark.slow
def test_final_logit_softcapping_in_the_logprobs(gemma3, capsys):
    """``final_logit_softcapping``: the engine's logprobs are HF's capped ones (a cap
    keeps the greedy token, so tokens alone cannot show it); ``attn_logit_softcapping``
    is set too and, as in HF's Gemma 3, not applied."""
    from transformers import AutoModelForCausalLM

    cap = 2.0
    path = gemma3(final_logit_softcapping=cap, attn_logit_softcapping=5.0)
    prompts = _prompts(7, lengths=(12, 90), tails=())
    llm = LLM(str(path), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = uncapped_gap = 0.0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt + out.token_ids])
            logits = hf(ids).logits[0, len(prompt) - 1:-1]               # capped by HF
            assert logits.abs().max() <= cap
            assert out.token_ids == logits.argmax(-1).tolist()
            ref = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            got = torch.tensor([step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)])
            worst = max(worst, float((got - ref).abs().max()))
            raw = torch.atanh(logits / cap) * cap                        # the logits before the cap
            uncapped = raw.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            uncapped_gap = max(uncapped_gap, float((uncapped - ref).abs().max()))
    assert worst < 1e-4 < 0.1 < uncapped_gap
    _report(capsys, f"final_logit_softcapping {cap}: logprobs within {worst:.1e} of HF "
                    f"(uncapped ones differ by {uncapped_gap:.2f})")


@pytest.mark.slow
def test_planner_sizes_the_hybrid_pools_as_the_engine(gemma3, capsys):
    """The plan for a pinned KV byte budget names the engine's full-pool blocks, token
    capacity and windowed pool for Gemma 3's 5 local to 1 global layers, and its
    KV-capacity concurrency (every sequence at the p95 length at once) runs without a
    preemption."""
    prompt_len, output_len = 40, 24
    plan, llm = plan_and_engine(gemma3(), 40 * BLOCK * 6 * 2 * 256 * 4, BLOCK, prompt_len, output_len)
    assert plan.num_sliding_pool_layers == 5 and plan.sliding_window == WINDOW
    engine = llm.llm_engine
    info, kv = engine.cache_info, engine.kv_cache_manager
    # one table for all six layers would hold fewer tokens
    one_table = plan.kv_cache_memory_bytes // (BLOCK * plan.kv_bytes_per_token) * BLOCK
    assert plan.kv_token_capacity > one_table
    assert run_at_once(llm, plan.max_num_seqs, prompt_len, output_len) == plan.max_num_seqs
    assert engine.scheduler.num_preemptions == 0
    _report(capsys, f"planner vs engine ({plan.kv_cache_memory_bytes:,} B of KV): plan {plan.num_gpu_blocks} "
                    f"full-pool blocks = {plan.kv_token_capacity} tokens + {plan.sliding_pool_blocks} windowed "
                    f"blocks; engine {info.num_gpu_blocks} = {info.token_capacity} tokens + "
                    f"{kv.sliding.pool.num_blocks}; one shared table: {one_table} tokens; plan max_num_seqs "
                    f"{plan.max_num_seqs} ran at once, 0 preemptions")


def test_norm_and_embedding_scale_round_as_hf_in_bfloat16():
    """Gemma's norm rounds once after the ``1 + weight`` gain and the embedding
    normaliser is rounded to the model dtype (sqrt(48) = 6.93 -> 6.9375 in bfloat16):
    bit-identical to HF's modules in bfloat16."""
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RMSNorm,
        Gemma3TextScaledWordEmbedding,
    )

    from kvpilot.engine.model.hf_config import parse_arch_config
    from kvpilot.engine.model.layers.norm import GemmaRMSNorm
    from kvpilot.engine.model.models.gemma3 import Gemma3ForCausalLM

    torch.manual_seed(0)
    x = torch.randn(7, 48).to(torch.bfloat16)
    ours, theirs = GemmaRMSNorm(48, 1e-6), Gemma3RMSNorm(48, 1e-6)
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.5)
        ours.weight.copy_(theirs.weight)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    cfg = parse_arch_config({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 32, "hidden_size": 48,
                             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "head_dim": 24})
    model = Gemma3ForCausalLM(cfg, 64).to(torch.bfloat16)
    hf = Gemma3TextScaledWordEmbedding(32, 48, 0, embed_scale=48 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(32, 48))
        hf.weight.copy_(model.embed_tokens.weight)
    ids = torch.arange(32)
    assert torch.equal(model.embed(ids), hf(ids))
    assert not torch.equal(model.embed(ids), (model.embed_tokens(ids).float() * math.sqrt(48)).to(torch.bfloat16))
