"""The server through the real ``openai`` SDK: outputs must equal the offline engine's."""

from __future__ import annotations

import json
import random
from importlib import metadata
from pathlib import Path

import httpx
import pytest
import tokenizers

from kvpilot.engine import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."}]


def test_greedy_completion_equals_llm_generate(client, settings, offline_llm):
    for prompt in PROMPTS:
        resp = client.completions.create(model=settings.model, prompt=prompt, max_tokens=12,
                                         temperature=0)
        [expected] = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
        choice = resp.choices[0]
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == expected.outputs[0].finish_reason == "length"
        assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids) == 12
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
        assert resp.model == settings.model


def test_seeded_sampling_equals_llm_and_reproduces(client, settings, offline_llm):
    kwargs = dict(model=settings.model, prompt=PROMPTS[0], max_tokens=6, temperature=1.0,
                  top_p=0.9)
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    again = client.completions.create(seed=1234, **kwargs).choices[0].text
    other = client.completions.create(seed=4321, **kwargs).choices[0].text
    [expected] = offline_llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9,
                                                                 max_tokens=6, seed=1234))
    assert first == again == expected.outputs[0].text
    assert other != first


def test_chat_equals_llm_chat(client, settings, offline_llm):
    resp = client.chat.completions.create(model=settings.model, messages=CHAT, max_tokens=10,
                                          temperature=0)
    [expected] = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))
    msg = resp.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 10
    # max_completion_tokens is the newer name of the same limit
    resp2 = client.chat.completions.create(model=settings.model, messages=CHAT,
                                           max_completion_tokens=10, temperature=0)
    assert resp2.choices[0].message.content == msg.content


def test_completion_stream_equals_non_stream(client, settings):
    kwargs = dict(model=settings.model, prompt=PROMPTS[1], max_tokens=8, temperature=0.8,
                  seed=7, n=2)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    by_index = {c.index: c for c in full.choices}
    assert sorted(by_index) == [0, 1]
    assert texts == {i: by_index[i].text for i in (0, 1)}
    assert finish == {i: by_index[i].finish_reason for i in (0, 1)}
    assert by_index[0].text != by_index[1].text  # child i is seeded seed + i


def test_stream_end_written_at_once_is_still_separate_events(client, http, settings):
    """The last token's chunk, the usage chunk and ``[DONE]`` go out in one body write
    (issue 28: fewer writes per stream); the SDK still sees each token's chunk, then the
    finish, then the usage, each its own event, and the raw stream its own frames."""
    kwargs = dict(model=settings.model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    body = {"model": settings.model, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        raw = b"".join(resp.iter_bytes())
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    events = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-2]]
    assert all(f.startswith(b"data: {") for f in frames[:-2])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # deltas that pile up while the stream is busy are folded into one (engine_client), so
    # the two streams may cut the text differently: the text, not the cuts, must agree
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full.choices[0].text
    assert all(e["choices"][0]["text"] for e in events[:-2])   # no empty chunk before the end
    assert b" " not in frames[0].split(b'"choices"')[0].removeprefix(b"data: ")  # compact JSON


def test_chat_stream_equals_non_stream(client, settings):
    kwargs = dict(model=settings.model, messages=CHAT, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_raw_sse_ends_with_done(http, settings):
    body = {"model": settings.model, "prompt": "hi", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in resp.iter_lines() if line]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    for frame in frames[:-1]:
        json.loads(frame.removeprefix("data: "))


def test_stop_string(client, settings):
    base = dict(model=settings.model, prompt=PROMPTS[0], temperature=1.0, seed=99)
    reference = client.completions.create(max_tokens=24, **base).choices[0].text
    assert len(reference) >= 8, reference
    stop = reference[len(reference) // 2: len(reference) // 2 + 2]
    expected = reference[: reference.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(max_tokens=24, stop=[stop], stream=True, **base))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(max_tokens=24, stop=stop, **base).choices[0]
            text, finish = choice.text, choice.finish_reason
            assert choice.model_extra.get("stop_reason") == stop
        assert text == expected
        assert finish == "stop"


def test_completion_logprobs(client, settings):
    resp = client.completions.create(model=settings.model, prompt=PROMPTS[0], max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) >= 3 or len(set(top)) < 3  # distinct texts; colliding ones merge
        assert token_lp <= 0
        # greedy: the sampled token is the most likely one
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5)


def test_chat_logprobs(client, settings):
    resp = client.chat.completions.create(model=settings.model, messages=CHAT, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8") == c.token
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)


def test_multiple_prompts_in_one_request(client, settings, offline_llm):
    resp = client.completions.create(model=settings.model, prompt=PROMPTS, max_tokens=5,
                                     temperature=0, n=2)
    assert [c.index for c in sorted(resp.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    expected = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5))
    by_index = {c.index: c.text for c in resp.choices}
    for i, out in enumerate(expected):
        assert by_index[2 * i] == by_index[2 * i + 1] == out.outputs[0].text


def test_token_id_prompt_and_prefix_cache_salt(client, settings):
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 100_000) for _ in range(600)]
    kwargs = dict(model=settings.model, prompt=prompt, max_tokens=1, temperature=0)
    client.completions.create(extra_body={"cache_salt": "tenant-a"}, **kwargs)
    hit = client.completions.create(extra_body={"cache_salt": "tenant-a"}, **kwargs)
    other = client.completions.create(extra_body={"cache_salt": "tenant-b"}, **kwargs)
    assert hit.usage.prompt_tokens == 600
    # all full blocks but the last one (whose last token must be recomputed) are hits
    assert hit.usage.prompt_tokens_details.cached_tokens >= 0.9 * 600
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].text == other.choices[0].text


def test_models_alias_and_version(client, http, settings):
    models = client.models.list()
    assert [m.id for m in models.data] == [settings.model, settings.alias]
    assert all(m.model_extra["max_model_len"] == settings.max_model_len for m in models.data)
    resp = client.completions.create(model=settings.alias, prompt="hi", max_tokens=1)
    assert resp.model == settings.model
    assert http.get("/version").json() == {"version": metadata.version("kvpilot")}


def test_render_routes_give_the_token_ids_the_engine_runs(http, client, settings, offline_llm):
    """vLLM's render routes (vllm-router's kv_aware policy reads them): the ids of each
    prompt, as the tokenizers library encodes them and as many as the completion's usage
    counts; the chat render is the templated conversation /tokenize gives."""
    model_dir = Path(offline_llm.llm_engine.model_config.model)
    oracle = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = ["Paged attention, prefix caching", "und Grüße 👋"]
    resp = http.post("/v1/completions/render", json={"model": settings.model, "prompt": prompts})
    assert resp.status_code == 200
    assert resp.json() == [{"token_ids": oracle.encode(p).ids} for p in prompts]
    one = http.post("/v1/completions/render", json={"model": settings.model, "prompt": prompts[0]}).json()
    done = client.completions.create(model=settings.model, prompt=prompts[0], max_tokens=1)
    assert len(one[0]["token_ids"]) == done.usage.prompt_tokens
    chat = http.post("/v1/chat/completions/render", json={"model": settings.model, "messages": CHAT})
    assert chat.status_code == 200
    assert chat.json()["token_ids"] == http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    answered = client.chat.completions.create(model=settings.model, messages=CHAT, max_tokens=1)
    assert len(chat.json()["token_ids"]) == answered.usage.prompt_tokens
    assert httpx.post(f"{http.base_url}/v1/completions/render", json={"prompt": "x"}).status_code == 401
    bad = http.post("/v1/completions/render", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


def test_without_kv_events_there_are_no_event_sources(http):
    """This server publishes no KV events: vllm-router's discovery finds no sources (it
    then scores the worker on load alone; the sources: tests/kv_events/test_discovery.py)."""
    response = httpx.get(f"{http.base_url}/kv_event_sources")      # asked without the key
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "kv_events_disabled"


def test_tokenize_detokenize_match_the_tokenizers_library(http, settings, offline_llm):
    # The checkpoint's tokenizer.json, run by the tokenizers library itself, is the oracle.
    model_dir = Path(offline_llm.llm_engine.model_config.model)
    oracle = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Paged attention, prefix caching — und Grüße 👋"
    resp = http.post("/tokenize", json={"model": settings.model, "prompt": text})
    assert resp.status_code == 200
    body = resp.json()
    assert body["tokens"] == oracle.encode(text).ids
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == settings.max_model_len
    back = http.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert oracle.decode(chat["tokens"], skip_special_tokens=False).startswith("<|im_start|>system")
