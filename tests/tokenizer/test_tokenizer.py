"""kvpilot's Tokenizer against HF transformers' AutoTokenizer on the same checkpoint files."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine.text.chat_templates import ChatTemplateError
from kvpilot.engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " Hello world ",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1)\n",
    "   multiple   spaces\tand\ttabs\n\n\nnewlines",
    "Ünïcödé façade naïve café — “quotes”",
    "中文字符 日本語の文章 한국어 Ωμέγα",
    "emoji 🙂🚀👍🏽 and unseen ones 🎉🦄",
    "<|begin_of_text|>already has a BOS<|eot_id|> and <tool> inline",
    "",
]

# A Llama-3-like template written for these tests: BOS variable, a default system
# turn with today's year (strftime_now), tools as pretty JSON, namespace, loop controls.
LLAMA_STYLE = """{{- bos_token }}
{%- set ns = namespace(system="You are a helpful assistant.") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Year: ' + strftime_now('%Y') + '\\n' }}
{%- if tools is not none %}
    {{- 'Tools:\\n' }}
    {%- for tool in tools %}{{- tool | tojson(indent=4) }}{{- '\\n' }}{%- endfor %}
{%- endif %}
{{- ns.system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}{{- call.function | tojson }}{%- endfor %}
    {%- else %}
        {{- message['content'] | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# A Qwen-2.5-like tool template written for these tests: tools in the system turn,
# <tool_call> JSON, consecutive tool results grouped into one user turn, a
# {% generation %} block, and a template switch (enable_thinking).
QWEN_STYLE = """{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}

# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user
{%- endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <b>now</b> & later",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "e.g. Zürich, 北京"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "  Be terse.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Et en français ? 中文？🙂"},
    ],
    [
        {"role": "user", "content": "Weather in Zürich and 北京?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "北京"}},
                },
            ],
        },
        {"role": "tool", "content": '{"temp": 21, "sky": "<sunny> & clear"}'},
        {"role": "tool", "content": '{"temp": 30}'},
        {"role": "assistant", "content": "Both warm."},
    ],
]


def write_checkpoint_files(directory, tokenizer, tokenizer_config: dict, **extra_json):
    """Save a ``tokenizers.Tokenizer`` and JSON config files as a checkpoint directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, data in extra_json.items():
        (directory / f"{name}.json").write_text(json.dumps(data))
    return directory


def _bpe_checkpoint(directory, tokenizer, **config):
    base = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|end_of_text|>",
        "chat_template": LLAMA_STYLE,
    }
    base.update(config)
    return write_checkpoint_files(directory, tokenizer, base)


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory, byte_level_bpe):
    from transformers import AutoTokenizer

    path = _bpe_checkpoint(
        tmp_path_factory.mktemp("bpe"),
        byte_level_bpe,
        chat_template=[
            {"name": "default", "template": LLAMA_STYLE},
            {"name": "tool_use", "template": QWEN_STYLE},
        ],
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory, sentencepiece_style):
    from transformers import AutoTokenizer

    path = write_checkpoint_files(
        tmp_path_factory.mktemp("spm"),
        sentencepiece_style,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
        config={"eos_token_id": 2},
    )
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("pair_name", ["bpe_pair", "spm_pair"])
def test_encode_decode_like_transformers(request, pair_name):
    ours, hf = request.getfixturevalue(pair_name)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        for token in ours.convert_ids_to_tokens(ids):
            assert ours.token_to_id(token) == hf.convert_tokens_to_ids(token)
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id and ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)


def test_bos_comes_from_the_post_processor(bpe_pair, spm_pair):
    for ours, _ in (bpe_pair, spm_pair):
        assert ours.encode("Hello")[0] == ours.bos_token_id
        assert ours.encode("Hello", add_special_tokens=False)[0] != ours.bos_token_id


def test_eos_ids_from_generation_config_or_config(bpe_pair, spm_pair):
    ours, _ = bpe_pair
    assert ours.eos_token_id == ours.token_to_id("<|eot_id|>") == 2
    assert ours.eos_token_ids == frozenset({2, 1})
    ours, _ = spm_pair
    assert ours.eos_token_ids == frozenset({2})


def test_eos_ids_fall_back_to_config_json(tmp_path, byte_level_bpe):
    path = _bpe_checkpoint(tmp_path, byte_level_bpe, eos_token=None)
    (path / "generation_config.json").write_text('{"do_sample": false}')
    (path / "config.json").write_text('{"eos_token_id": [3, 4]}')
    ours = Tokenizer.from_pretrained(path)
    assert ours.eos_token_ids == frozenset({3, 4}) and ours.eos_token_id == 3


@pytest.mark.parametrize("template_name", ["default", "tool_use"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_render_like_transformers(
    bpe_pair, template_name, conversation, add_generation_prompt
):
    ours, hf = bpe_pair
    messages = CONVERSATIONS[conversation]
    for tools in (None, TOOLS):
        kwargs = {
            "chat_template": template_name,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
    extra = {"enable_thinking": False, "add_generation_prompt": add_generation_prompt}
    assert ours.apply_chat_template(
        messages, chat_template=QWEN_STYLE, **extra
    ) == hf.apply_chat_template(messages, chat_template=QWEN_STYLE, tokenize=False, **extra)


def test_tool_template_is_chosen_when_tools_are_given(bpe_pair):
    ours, hf = bpe_pair
    rendered = ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS)
    assert "<tools>" in rendered and '"Weather <b>now</b> & later"' in rendered  # no HTML escaping
    assert rendered == hf.apply_chat_template(
        CONVERSATIONS[0], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith(
        "<|begin_of_text|><|start_header_id|>system"
    )


def test_chat_template_jinja_file_takes_priority(tmp_path, byte_level_bpe):
    from transformers import AutoTokenizer

    path = _bpe_checkpoint(
        tmp_path, byte_level_bpe, chat_template="config template {{ messages[0].content }}"
    )
    (path / "chat_template.jinja").write_text("file template {{ messages[0].content }}")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "short.jinja").write_text(
        "short: {{ messages | length }}"
    )
    ours, hf = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "x"}]
    assert (
        ours.apply_chat_template(messages)
        == "file template x"
        == hf.apply_chat_template(messages, tokenize=False)
    )
    assert ours.apply_chat_template(messages, chat_template="short") == "short: 1"
    assert hf.apply_chat_template(messages, chat_template="short", tokenize=False) == "short: 1"


def test_template_errors_are_clear(bpe_pair, tmp_path, byte_level_bpe):
    ours, _ = bpe_pair
    with pytest.raises(ChatTemplateError, match="Unknown role: critic"):
        ours.apply_chat_template([{"role": "critic", "content": "meh"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="no 'role'"):
        ours.apply_chat_template([{"content": "hi"}])
    with pytest.raises(TypeError, match="list of dicts"):
        ours.apply_chat_template("hi")
    bare = _bpe_checkpoint(tmp_path, byte_level_bpe, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_pretrained(bare).apply_chat_template(CONVERSATIONS[0])


def test_sandbox_blocks_python_internals(bpe_pair):
    ours, _ = bpe_pair
    with pytest.raises(Exception, match="unsafe|SecurityError|not safely|access"):
        ours.apply_chat_template(
            CONVERSATIONS[0], chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}"
        )


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_bad_config_values_are_clear_errors(tmp_path, byte_level_bpe):
    _bpe_checkpoint(tmp_path, byte_level_bpe, eos_token=42)
    with pytest.raises(ValueError, match="eos_token must be a string"):
        Tokenizer.from_pretrained(tmp_path)
    _bpe_checkpoint(tmp_path, byte_level_bpe)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ValueError, match="eos_token_id must be an int"):
        Tokenizer.from_pretrained(tmp_path)


def test_tokens_declared_only_in_the_config_are_added(tmp_path, byte_level_bpe, request):
    from transformers import AutoTokenizer

    next_id = byte_level_bpe.get_vocab_size()
    declared = {str(next_id): {"content": "<|new|>", "special": True}}
    path = _bpe_checkpoint(
        tmp_path, byte_level_bpe, added_tokens_decoder=declared, unk_token="<|unk|>"
    )
    ours, hf = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert ours.token_to_id("<|new|>") == next_id == hf.convert_tokens_to_ids("<|new|>")
    assert ours.token_to_id("<|unk|>") == hf.unk_token_id
    text = "a <|new|> b <|unk|>"
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


def test_unknown_ids(bpe_pair):
    ours, _ = bpe_pair
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.convert_ids_to_tokens([10**6])
    assert ours.decode([10**6]) == ""  # the model's padded vocabulary rows decode to nothing
    with pytest.raises(TypeError, match="expects a str"):
        ours.encode(b"bytes")
