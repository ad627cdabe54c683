"""The tokenizer built from a GGUF file's metadata encodes, decodes and renders chats as
transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) does.

Two vocabularies: a byte-level BPE with merges (``tokenizer.ggml.model`` gpt2, as SmolLM2
and Qwen files have) and a SentencePiece BPE with byte fallback and no merges, which both
sides rebuild from the scores (``llama``, as Llama 2 / Mistral files have; BOS added by
default as llama.cpp does), also as a Gemma file (tokens of spaces respelled, merges
ranked by vocabulary order).
"""

from __future__ import annotations

import pytest

from kvpilot.engine.text.tokenizer import Tokenizer

from support.gguf_files import VOCAB, write_gguf

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Prefix caching reuses blocks: naïve café, 日本語 and 🤖 (byte fallback)",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece", "gemma-sentencepiece"])
def pair(request, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(request.param)
    kind = "gemma3" if request.param.startswith("gemma") else "llama"
    write_gguf(path / "model.gguf", kind, "F16", sentencepiece=request.param.endswith("sentencepiece"))
    return request.param, Tokenizer.from_pretrained(path / "model.gguf"), \
        AutoTokenizer.from_pretrained(path, gguf_file="model.gguf")


def test_encode_decode_match_transformers(pair):
    kind, ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids
    # llama.cpp's default: BOS before a SentencePiece prompt, none before a byte-level one
    assert (ours.encode("hi")[0] == ours.bos_token_id) == kind.endswith("sentencepiece")


def test_special_tokens_and_chat_template(pair):
    kind, ours, ref = pair
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.vocab_size == VOCAB        # the file's tokens (transformers' GemmaTokenizer
    if not kind.startswith("gemma"):       # appends its default <pad>/<eos>/<bos>/<mask>)
        assert len(ref) == VOCAB
    assert ours.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT, tokenize=False,
                                                                     add_generation_prompt=True)
