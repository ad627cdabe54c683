"""The characters-per-token bound holds against the real tokenizers on adversarial texts,
and is withheld (None) for tokenizers that can delete characters."""

from __future__ import annotations

import json
import sys
import unicodedata

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from kvpilot.engine.text.length_bound import MAX_COMPOSED_CODE_POINTS, max_chars_per_token


def test_max_composed_code_points_is_unicodes_longest_canonical_decomposition():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
                  if not 0xD800 <= c <= 0xDFFF)
    assert longest == MAX_COMPOSED_CODE_POINTS


def _adversarial_texts(backend: Tokenizer) -> list[str]:
    vocab = backend.get_vocab()
    longest = max(vocab, key=lambda s: len(s.encode()))
    decoded = backend.decode([vocab[longest]])
    return [
        " " * 5000, "=" * 5000, "a" * 5000, decoded * 50,
        "\u1100\u1161\u11a8" * 1000,              # Hangul jamo: NFC makes one syllable of three
        "\u03c9\u0314\u0300\u0345" * 1000,        # four code points NFC composes into U+1F82
        "e\u0301" * 2000, "中文字符🙂" * 500, "\n" * 3000,
    ]


@pytest.mark.parametrize("fixture", ["byte_level_bpe", "sentencepiece_style"])
def test_no_text_needs_fewer_tokens_than_the_bound_says(fixture, request):
    backend: Tokenizer = request.getfixturevalue(fixture)
    bound = max_chars_per_token(json.loads(backend.to_str()))
    assert bound is not None
    for text in _adversarial_texts(backend):
        num_tokens = len(backend.encode(text, add_special_tokens=False).ids)
        assert num_tokens * bound >= len(text), (text[:20], num_tokens, bound)


def test_demo_tokenizer_bound(demo_tokenizer):
    bound = demo_tokenizer.max_chars_per_token
    spec = json.loads(demo_tokenizer.backend.to_str())
    assert spec["normalizer"]["type"] == "NFC"
    longest = max(len(s.encode()) for s in spec["model"]["vocab"])
    assert bound == longest * MAX_COMPOSED_CODE_POINTS
    for text in _adversarial_texts(demo_tokenizer.backend):
        assert len(demo_tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)


def _bpe(**parts) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], unk_token="[UNK]"))
    for name, value in parts.items():
        setattr(tok, name, value)
    return tok


@pytest.mark.parametrize("backend", [
    _bpe(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
    _bpe(normalizer=normalizers.Strip()),
    _bpe(normalizer=normalizers.StripAccents()),
    _bpe(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")),
    Tokenizer(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
], ids=["whitespace-split", "strip", "strip-accents", "split-removed", "wordpiece"])
def test_no_bound_for_tokenizers_that_can_delete_characters(backend):
    assert max_chars_per_token(json.loads(backend.to_str())) is None


def test_why_deleting_tokenizers_get_no_bound():
    # The real library: a million spaces are zero tokens once whitespace splitting drops them.
    tok = _bpe(pre_tokenizer=pre_tokenizers.WhitespaceSplit())
    assert tok.encode(" " * 1_000_000, add_special_tokens=False).ids == []
