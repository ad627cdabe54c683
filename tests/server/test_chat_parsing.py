"""Reasoning and tool-call parsing of chat answers: each parser on whole answers, and the
property that matters for streaming: cutting the text into any pieces gives the same
reasoning, content and tool calls as the whole text."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.server.config import ChatConfig
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.parsing.chat_output import ChoiceOutput
from kvpilot.engine.server.parsing.tool_choice import plan_tools, required_schema
from kvpilot.engine.server.parsing.tool_parsers import (
    HermesExtractor,
    Llama3JsonExtractor,
    NamedFunctionExtractor,
    RequiredExtractor,
)
from kvpilot.engine.server.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
          '{"zone": "CET"}}\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}; '
         '{"name": "get_time", "parameters": {"zone": "UTC"}}')
REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}, '
            '{"name": "get_time", "parameters": {"zone": "CET"}}]')


def _run(make, text: str, cuts: list[int] | None = None, reasoning: str | None = None):
    """(reasoning, content, [(name, arguments)]) of ``text`` fed whole or cut at ``cuts``."""
    out = ChoiceOutput(reasoning, make)
    bounds = sorted({c for c in (cuts or []) if 0 < c < len(text)})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    streamed = {"reasoning": "", "content": "", "calls": {}}
    for i, piece in enumerate(pieces):
        parts = out.feed(piece, final=i == len(pieces) - 1)
        streamed["reasoning"] += parts.reasoning
        streamed["content"] += parts.content
        for call in parts.tool_calls:
            entry = streamed["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call["function"]["arguments"]
    calls = [(c.name, c.arguments) for c in out.tool_calls]
    # what the deltas add up to is what the object accumulated
    assert streamed["reasoning"] == out.reasoning and streamed["content"] == out.content
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed["calls"].items())] == calls
    return out.reasoning, out.content, calls


def test_hermes_calls_and_content():
    reasoning, content, calls = _run(HermesExtractor, HERMES)
    assert content == "Let me check.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]
    # no call: all content; a broken block stays content; an unclosed last block still counts
    assert _run(HermesExtractor, "just text")[1:] == ("just text", [])
    assert _run(HermesExtractor, "<tool_call>{oops}</tool_call>")[1:] == (
        "<tool_call>{oops}</tool_call>", [])
    assert _run(HermesExtractor, '<tool_call>{"name": "f", "arguments": {}}')[2] == [("f", "{}")]


def test_llama3_json_calls_and_content():
    _, content, calls = _run(Llama3JsonExtractor, LLAMA)
    assert content == ""
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Rome", "unit": "f"}), ("get_time", {"zone": "UTC"})]
    assert _run(Llama3JsonExtractor, "The answer is {x}")[1:] == ("The answer is {x}", [])
    assert _run(Llama3JsonExtractor, '{"not": "a call"}')[1:] == ('{"not": "a call"}', [])


def test_required_and_named_extractors():
    _, content, calls = _run(RequiredExtractor, REQUIRED)
    assert content == "" and [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": "Oslo", "unit": "c"}
    cut_short = REQUIRED[:80]
    _, content, calls = _run(RequiredExtractor, cut_short)
    assert len(calls) == 1 and content.startswith('{"name"') and cut_short.endswith(content)
    args = '{"city": "Lima", "unit": "f"}'
    assert _run(lambda: NamedFunctionExtractor("get_weather"), args)[2] == [("get_weather", args)]


def test_qwen3_reasoning():
    text = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    assert _run(None, text, reasoning="qwen3")[:2] == ("\nThe user wants weather.\n",
                                                       "\n\nIt is sunny.")
    assert _run(None, "No thinking here.", reasoning="qwen3")[:2] == ("", "No thinking here.")
    assert _run(None, "<think>cut off", reasoning="qwen3")[:2] == ("cut off", "")
    assert _run(None, "<thi", reasoning="qwen3")[:2] == ("", "<thi")
    # reasoning first, then the tool calls in the content
    both = _run(HermesExtractor, "<think>weather?</think>" + HERMES, reasoning="qwen3")
    assert both[0] == "weather?" and both[1] == "Let me check.\n" and len(both[2]) == 2


CASES = [(HermesExtractor, HERMES, None), (Llama3JsonExtractor, LLAMA, None),
         (RequiredExtractor, REQUIRED, None), (HermesExtractor, "plain <tool answer", None),
         (HermesExtractor, "<think>a</think>\n" + HERMES, "qwen3"),
         (None, "<think>x</thi</think>y<think>", "qwen3")]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(1, 300), max_size=12))
def test_streaming_in_any_pieces_equals_the_whole(case, cuts):
    make, text, reasoning = case
    assert _run(make, text, cuts, reasoning) == _run(make, text, None, reasoning)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_choice_plans():
    auto_chat = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert plan_tools(_request(), ChatConfig()).template_tools is None
    auto = plan_tools(_request(tools=[WEATHER]), auto_chat)
    assert auto.template_tools[0]["function"]["name"] == "get_weather" and auto.constraint is None
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(_request(tools=[WEATHER]), ChatConfig())
    none = plan_tools(_request(tools=[WEATHER], tool_choice="none"),
                      ChatConfig(exclude_tools_when_tool_choice_none=True))
    assert none.template_tools is None and none.make_extractor is None
    named = plan_tools(_request(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), ChatConfig())
    assert named.constraint.json == TIME["function"]["parameters"]
    with pytest.raises(APIError, match="not among the tools"):
        plan_tools(_request(tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "nope"}}), ChatConfig())
    with pytest.raises(APIError, match="needs tools"):
        plan_tools(_request(tool_choice="required"), ChatConfig())


def test_required_schema_accepts_exactly_valid_call_lists():
    schema = required_schema([WEATHER, TIME], parallel=True)
    jsonschema.validate(json.loads(REQUIRED), schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "x"}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema([WEATHER, TIME], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(REQUIRED), single)
