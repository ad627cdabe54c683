"""IncrementalDetokenizer: streamed deltas add up to the tokenizer's full decode, and a
delta never shows half a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.text.detokenizer import (
    MAX_PENDING_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from kvpilot.engine.text.tiktoken_convert import bytes_to_unicode
from kvpilot.engine.text.tokenizer import Tokenizer

SAMPLE = "Hi 🙂 中文 naïve — 👨‍👩‍👧 𝔘𝔫𝔦 ok\n"
FFFD = "\ufffd"
FAST = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    """Feed ``output_ids`` one by one; return (detokenizer, deltas, flushed)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(token_id) for token_id in output_ids]
    return detok, deltas, detok.flush()


def check_stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    detok, deltas, flushed = stream(tokenizer, prompt_ids, output_ids, skip_special_tokens)
    full = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + flushed == full == detok.text
    emitted = ""
    for k, delta in enumerate(deltas):
        emitted += delta
        so_far = tokenizer.decode(output_ids[: k + 1], skip_special_tokens=skip_special_tokens)
        assert so_far.startswith(emitted)  # nothing emitted is ever taken back
        if FFFD in delta:  # only where the full decode itself has one
            assert FFFD in so_far[: len(emitted)]


@pytest.fixture(scope="module")
def qwen(demo_tokenizer):
    return demo_tokenizer


@pytest.fixture(scope="module")
def qwen_id_pool(qwen):
    """Ids that stress the detokenizer: single-byte tokens (lead and continuation bytes),
    tokens of mixed text, special and non-special added tokens, padded-vocab ids."""
    table = bytes_to_unicode()
    byte_ids = [qwen.token_to_id(table[b]) for b in range(256)]
    utf8 = SAMPLE.encode()
    return {
        "bytes_of_sample": [byte_ids[b] for b in utf8],
        "any_byte": byte_ids,
        "text": qwen.encode(SAMPLE + " The quick brown fox."),
        "added": list(range(151643, 151669)),
        "padded": [151700, 151935],
    }


def qwen_ids(pool):
    return st.lists(
        st.one_of(
            st.sampled_from(pool["bytes_of_sample"]),
            st.sampled_from(pool["text"]),
            st.sampled_from(pool["any_byte"]),
            st.sampled_from(pool["added"]),
            st.sampled_from(pool["padded"]),
            st.integers(0, 151668),
        ),
        max_size=40,
    )


@FAST
@given(data=st.data(), skip=st.booleans())
def test_byte_level_deltas_add_up_to_the_full_decode(qwen, qwen_id_pool, data, skip):
    output_ids = data.draw(qwen_ids(qwen_id_pool))
    check_stream(qwen, [], output_ids, skip_special_tokens=skip)


@FAST
@given(data=st.data(), prompt=st.text(max_size=30))
def test_prompt_context_does_not_change_byte_level_text(qwen, qwen_id_pool, data, prompt):
    output_ids = data.draw(qwen_ids(qwen_id_pool))
    check_stream(qwen, qwen.encode(prompt), output_ids)


@FAST
@given(st.lists(st.booleans(), min_size=len(SAMPLE), max_size=len(SAMPLE)))
def test_characters_split_over_byte_tokens_are_held_back(qwen, inserts):
    """SAMPLE as one byte token per byte, with whole tokens between some characters:
    every multi-byte character is held back until complete, so no delta has U+FFFD."""
    table = bytes_to_unicode()
    the = qwen.token_to_id("Ġthe")
    ids = []
    for char, insert in zip(SAMPLE, inserts, strict=True):
        ids += [qwen.token_to_id(table[b]) for b in char.encode()]
        if insert:
            ids.append(the)
    detok, deltas, flushed = stream(qwen, qwen.encode("Say:"), ids)
    assert FFFD not in "".join(deltas) and flushed == ""
    assert detok.text == qwen.decode(ids)
    assert sum(1 for delta in deltas if delta) == len(SAMPLE) + sum(inserts)  # one per character


def test_example_stream(qwen):
    table = bytes_to_unicode()
    byte_ids = [qwen.token_to_id(table[b]) for b in "中🙂".encode()]
    detok = IncrementalDetokenizer(qwen, qwen.encode("Answer:"))
    assert [detok.add_token(i) for i in byte_ids] == ["", "", "中", "", "", "", "🙂"]
    assert detok.add_token(151645) == ""  # <|im_end|> is skipped
    assert detok.text == "中🙂"
    # a character cut short at the end comes out as U+FFFD on flush, as in the full decode
    detok = IncrementalDetokenizer(qwen, [])
    assert [detok.add_token(i) for i in byte_ids[:2]] == ["", ""]
    assert detok.flush() == FFFD == qwen.decode(byte_ids[:2])


def test_one_token_texts_are_remembered(qwen):
    ids = qwen.encode(SAMPLE * 3)
    assert [qwen.decode_piece(i) for i in ids] == [qwen.decode([i]) for i in ids]
    assert qwen.decode_piece(151645) == "" and qwen.decode_piece(151645, False) == "<|im_end|>"
    assert qwen.decode_piece(151645) == ""   # the two settings are kept apart


def test_special_tokens_kept_when_asked(qwen):
    ids = qwen.encode("hi<|im_end|>")
    detok, deltas, flushed = stream(qwen, [], ids, skip_special_tokens=False)
    assert detok.text == "hi<|im_end|>"


@pytest.mark.parametrize("kind", ["text", "invalid_bytes", "special_run"])
def test_work_per_token_is_bounded(qwen, kind):
    table = bytes_to_unicode()
    if kind == "text":
        ids = qwen.encode((SAMPLE + "Lorem ipsum dolor sit amet, 数据 🚀. ") * 60)
    elif kind == "invalid_bytes":  # lone continuation bytes never form a character
        ids = [qwen.token_to_id(table[0x80])] * 1500 + qwen.encode(" end 中")
    else:  # e.g. ignore_eos: a long run of skipped special tokens
        ids = qwen.encode("a") + [151643] * 1500 + qwen.encode(" b")
    detok = IncrementalDetokenizer(qwen, qwen.encode("prompt " * 50))
    windows = []

    def counting_decode(window, skip_special_tokens):
        windows.append(len(window))
        return qwen.backend.decode(window, skip_special_tokens=skip_special_tokens)

    detok._decode_fn = counting_decode  # observe the window sizes the detokenizer decodes
    text = detok.add_tokens(ids) + detok.flush()
    assert text == detok.text == qwen.decode(ids)
    # (a token that is whole characters on its own is its remembered one-token text and
    # decodes no window: a run of such tokens may decode none at all)
    assert max(windows, default=0) <= PROMPT_CONTEXT_TOKENS + 2 * MAX_PENDING_TOKENS, max(windows)
    assert sum(windows) / len(ids) < 4 * MAX_PENDING_TOKENS
    assert len(detok._ids) < 100  # old ids are dropped
    assert detok.num_output_tokens == len(ids)


# -- a sentencepiece-style tokenizer (Metaspace, byte fallback, leading-space strip) ----


@pytest.fixture(scope="module")
def spm(sentencepiece_style):
    return Tokenizer(sentencepiece_style, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


@FAST
@given(data=st.data())
def test_sentencepiece_style_stream(spm, data):
    # Whole words (some spelled in <0xNN> byte tokens) and special tokens, in any order.
    # Byte-fallback decoding turns a whole byte run into U+FFFDs once any byte of it is
    # invalid, which a stream cannot take back; valid output never does that.
    words = ["Hello", "world,", "the", "quick", "fox", "🙂", "Ωμέγα", "🎉", "123"]
    units = [spm.encode(" " + word, add_special_tokens=False) for word in words] + [[1], [2]]
    assert any(
        token.startswith("<0x") for unit in units for token in spm.convert_ids_to_tokens(unit)
    )
    output_ids = [
        i for unit in data.draw(st.lists(st.sampled_from(units), max_size=12)) for i in unit
    ]
    detok, deltas, flushed = stream(spm, [], output_ids)
    assert "".join(deltas) + flushed == detok.text == spm.decode(output_ids)  # no prompt: exact
    assert FFFD not in detok.text
    prompt = spm.encode(data.draw(st.sampled_from(["Say", "The answer is", "x y z w v u"])))
    detok, _, _ = stream(spm, prompt, output_ids)
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    # with a prompt: the text the output adds after the prompt (keeps its leading space)
    assert detok.text == spm.decode(context + output_ids)[len(spm.decode(context)) :]


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt(spm):
    prompt = spm.encode("The quick")
    output = spm.encode("fox", add_special_tokens=False)
    assert spm.convert_ids_to_tokens(output)[0].startswith("▁")
    detok, _, _ = stream(spm, prompt, output)
    assert detok.text == " fox"
    assert spm.decode(output) == "fox"  # decoded alone, the leading space is stripped
