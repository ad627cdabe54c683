"""Structured outputs, tool calling and reasoning through the real ``openai`` SDK, against
the demo model (random weights): every answer must be valid by the grammar alone.
Outputs are checked by independent validators (``jsonschema``, ``re``), and each
streamed answer must add up to the plain answer of the same seeded request.

The app runs in-process (the SDK talks to it over an ASGI transport) around one engine
with room for 64 sequences, so the 50-request check runs as one batch.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvpilot.engine.bench.structured import PET_SCHEMA
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.server.app import build_app, build_in_process_client
from kvpilot.engine.server.config import ChatConfig, ServerConfig
from kvpilot.engine.server.metrics import make_registry

pytestmark = pytest.mark.slow

MODEL = "kvpilot-demo"
PET = PET_SCHEMA  # nested object, array, enums, required fields
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a time zone",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Tell me about a pet, and the weather."}]


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineArgs("demo", kv_cache_memory_bytes=96 << 20, max_model_len=1024,
                                  max_num_seqs=64))
    yield engine
    assert not engine.has_unfinished_requests()


def run_with_client(engine, config: ServerConfig, scenario) -> None:
    """``await scenario(client)`` with an ``openai.AsyncOpenAI`` client of the app."""
    async_engine, state = build_in_process_client(lambda: engine, config, make_registry())
    app = build_app(state)

    async def main() -> None:
        async_engine.start()
        await async_engine.wait_ready()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app",
                                 timeout=600)
        async with openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused",
                                      http_client=http, max_retries=0) as client:
            await scenario(client)

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()


async def _streamed(client, **kwargs) -> dict:
    """The stream of a chat request, added up: content, reasoning, tool calls, finish."""
    result = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            result["content"] += delta.content or ""
            result["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = result["calls"].setdefault(call.index, {"name": None, "arguments": ""})
                if call.function and call.function.name:
                    entry["name"] = call.function.name
                    assert call.id and call.type == "function"
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            result["finish_reason"] = choice.finish_reason or result["finish_reason"]
    result["calls"] = [(c["name"], c["arguments"]) for _, c in sorted(result["calls"].items())]
    return result


def test_fifty_json_schema_answers_validate_and_streams_match(engine):
    """Acceptance: 50 requests with a json_schema response format (nested object, array,
    enums, required fields) all answer JSON that validates; streams equal plain answers."""

    def ask(i: int) -> dict:   # greedy: 50 different questions give 50 different pets
        return dict(model=MODEL, messages=[{"role": "user", "content": f"Describe pet {i}."}],
                    response_format=PET_FORMAT, temperature=0, max_tokens=300)

    async def scenario(client) -> None:
        plain = [client.chat.completions.create(**ask(i)) for i in range(50)]
        streams = [_streamed(client, **ask(i)) for i in range(5)]
        answers = await asyncio.gather(*plain, *streams)
        texts = [a.choices[0].message.content for a in answers[:50]]
        valid = 0
        for answer, text in zip(answers[:50], texts, strict=True):
            jsonschema.validate(json.loads(text), PET)
            assert answer.choices[0].finish_reason == "stop"
            valid += 1
        assert valid == 50
        assert len(set(texts)) >= 10                       # not one fixed answer
        for i, streamed in enumerate(answers[50:]):
            assert streamed["content"] == texts[i] and streamed["finish_reason"] == "stop"

    run_with_client(engine, ServerConfig(), scenario)


def test_required_and_named_tool_choices_give_valid_calls(engine):
    def base(i: int) -> dict:
        return dict(model=MODEL, messages=[{"role": "user", "content": f"Weather or time {i}?"}],
                    tools=TOOLS, temperature=0, max_tokens=200)

    async def scenario(client) -> None:
        required = [dict(base(i), tool_choice="required", parallel_tool_calls=False)
                    for i in range(3)]
        named = [dict(base(i), tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
                 for i in range(3)]
        parallel = dict(base(9), tool_choice="required", max_tokens=120)
        checked = [*required, *named, parallel]
        streams = [required[0], named[0], parallel]
        answers = await asyncio.gather(*(client.chat.completions.create(**k) for k in checked),
                                       *(_streamed(client, **k) for k in streams))
        plain, streamed = answers[:len(checked)], answers[len(checked):]
        stream_of = {id(k): s for k, s in zip(streams, streamed, strict=True)}
        for kwargs, answer in zip(checked, plain, strict=True):
            choice = answer.choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            assert calls
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), PARAMETERS[name])
            assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
                       for c in choice.message.tool_calls)
            stream = stream_of.get(id(kwargs))
            if stream is not None:
                assert stream["calls"] == calls and stream["finish_reason"] == choice.finish_reason
            if kwargs is parallel:   # as many calls as the model writes (here: to max_tokens)
                assert len(calls) >= 2
            elif kwargs["tool_choice"] == "required":
                assert choice.finish_reason == "tool_calls" and len(calls) == 1
                assert choice.message.content is None
            else:
                assert [name for name, _ in calls] == ["get_weather"]
                assert choice.finish_reason == "stop" and choice.message.content is None

    run_with_client(engine, ServerConfig(), scenario)


HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"unit": "celsius", "days": [1-7]\}\}\n</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(engine):
    """The hermes parser finds the call in the model's text; here a regex makes the random
    model write one, so the whole path (template, generation, parsing) runs for real."""
    chat = ChatConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")

    async def scenario(client) -> None:
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=4,
                      max_tokens=100, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
        answer = await client.chat.completions.create(**kwargs)
        streamed = await _streamed(client, **kwargs)
        choice = answer.choices[0]
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert streamed["calls"] == [("get_weather", call.function.arguments)]
        assert streamed["content"] == "" and streamed["finish_reason"] == "tool_calls"
        # free text stays content
        text = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                    max_tokens=5, temperature=0)
        assert text.choices[0].message.content and not text.choices[0].message.tool_calls
        # the call and its result go back into the conversation (tool role)
        history = [*ASK, answer.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        follow_up = await client.chat.completions.create(model=MODEL, messages=history,
                                                         tools=TOOLS, max_tokens=1)
        tokenizer = engine.tokenizer
        rendered = tokenizer.apply_chat_template(
            [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}], tools=TOOLS)
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
        assert follow_up.usage.prompt_tokens == len(tokenizer.encode(rendered,
                                                                     add_special_tokens=False))

    run_with_client(engine, ServerConfig(chat=chat), scenario)


def test_reasoning_parser_splits_think_sections(engine):
    chat = ChatConfig(reasoning_parser="qwen3")
    pattern = r"<think>[a-z ]{3,20}</think>[A-Z][a-z]{2,12}\."

    async def scenario(client) -> None:
        kwargs = dict(model=MODEL, messages=ASK, temperature=1.0, seed=2, max_tokens=80,
                      extra_body={"structured_outputs": {"regex": pattern}})
        answer = (await client.chat.completions.create(**kwargs)).choices[0].message
        assert re.fullmatch(r"[a-z ]{3,20}", answer.reasoning_content)
        assert re.fullmatch(r"[A-Z][a-z]{2,12}\.", answer.content)
        streamed = await _streamed(client, **kwargs)
        assert (streamed["reasoning"], streamed["content"]) == (answer.reasoning_content,
                                                                answer.content)

    run_with_client(engine, ServerConfig(chat=chat), scenario)


def test_constraints_on_completions_and_bad_constraints(engine):
    async def scenario(client) -> None:
        for extra in ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                      {"guided_choice": ["red", "green", "blue"]}):
            done = await client.completions.create(model=MODEL, prompt="Colour:", max_tokens=10,
                                                   seed=1, extra_body=extra)
            assert done.choices[0].text in ("red", "green", "blue")
        bad = [
            (dict(response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": 3}}}), "response_format"),
            (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs"),
            (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
             "structured_outputs"),
            (dict(response_format={"type": "json_object"},
                  extra_body={"guided_regex": "a+"}), "guided_regex"),
            (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
             "response_format"),
            (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
             "tool_choice"),
            (dict(tools=TOOLS), "tool_choice"),       # auto needs --enable-auto-tool-choice
            (dict(tool_choice="required"), "tool_choice"),
        ]
        for kwargs, param in bad:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                                     **kwargs)
            assert info.value.body["param"] == param, (kwargs, info.value.body)

    run_with_client(engine, ServerConfig(), scenario)
