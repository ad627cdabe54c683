"""``kvpilot bench peer --synthetic``'s GGUF writer (``bench.synthetic_gguf``), at tiny
shapes: its files run token-identical in the engine and in transformers' GGUF loader (the
oracle), and its Qwen vocabulary tokenizes as Qwen's own tokenizer does."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.bench import synthetic_gguf as sg

from support.hf_oracle import hf_greedy

MAX_NEW = 6
TINY = {   # the real layouts (q/k/v bias; q/k norms, window, 1 KV head), tiny; Gemma's head_dim 256
    # as transformers takes query_pre_attn_scalar (absent from GGUF) to be 256, llama.cpp head_dim
    "qwen2": sg.SyntheticModel("qwen2", 64, 2, 4, 2, 16, 128, 512, "synthetic", 1e6, 256),
    "gemma3": sg.SyntheticModel("gemma3", 64, 6, 2, 1, 256, 128, 512, "synthetic", 1e6, 256, sliding_window=16),
}


@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_file_runs_as_transformers_runs_it(tmp_path, arch):
    model = TINY[arch]
    sg.write_synthetic_gguf(tmp_path / "model.gguf", model, seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(6, model.vocab_size) for _ in range(n)] for n in (1, 9, 40)]   # 40 > window
    expected = hf_greedy(tmp_path, prompts, MAX_NEW, gguf_file="model.gguf")
    assert len({t for out in expected for t in out}) > 3     # not one repeated token
    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", num_gpu_blocks=32, max_model_len=128)
    assert llm.llm_engine.model_config.arch.num_hidden_layers == model.num_layers
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))]
    assert got == expected


def test_qwen_vocabulary_tokenizes_as_qwen(tmp_path):
    from transformers import AutoTokenizer

    from kvpilot.engine.model.models.demo import build_qwen_tokenizer

    tiny = dataclasses.replace(TINY["qwen2"], vocab="qwen", vocab_size=sg.MODELS["qwen2.5-0.5b"].vocab_size)
    sg.write_synthetic_gguf(tmp_path / "model.gguf", tiny)
    text = "Hello, world! <|im_start|>user\nÜber 12345 tokens\t café<|im_end|>"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    assert tokenizer.encode(text, add_special_tokens=False) == build_qwen_tokenizer().encode(text).ids
    assert len(tokenizer) == tiny.vocab_size


def test_real_shapes_are_the_models():
    qwen, gemma = sg.MODELS["qwen2.5-0.5b"], sg.MODELS["gemma3-270m"]
    sizes = {m: sum(r * (c[0] if c else 1) for _, (r, *c) in sg.tensor_shapes(m)) for m in (qwen, gemma)}
    assert 490e6 < sizes[qwen] < 500e6      # Qwen2.5-0.5B: 494M parameters (tied)
    assert 265e6 < sizes[gemma] < 270e6     # Gemma 3 270M: 268M parameters (tied)
