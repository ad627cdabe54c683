"""Bad input, authentication, a full waiting queue and client disconnects.

Every error must come back as OpenAI error JSON with the right status, and the
server must keep serving afterwards.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def assert_error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def test_prompt_over_context_length(http, settings):
    too_long = [1000 + i for i in range(settings.max_model_len + 52)]
    error = assert_error(http.post("/v1/completions", json={"prompt": too_long}), 400,
                         str(settings.max_model_len), str(len(too_long)))
    assert error["code"] == "context_length_exceeded"
    # prompt fits, prompt + max_tokens does not: both numbers and their sum are given
    prompt = [1000 + i for i in range(settings.max_model_len - 10)]
    body = {"prompt": prompt, "max_tokens": 50}
    assert_error(http.post("/v1/completions", json=body), 400, str(settings.max_model_len),
                 str(len(prompt)), "50", str(len(prompt) + 50))
    long_chat = {"messages": [{"role": "user", "content": "hello " * settings.max_model_len}]}
    assert_error(http.post("/v1/chat/completions", json=long_chat), 400,
                 str(settings.max_model_len))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/tokenize", {}, None),
    ("/tokenize", {"messages": []}, None),
])
def test_invalid_parameters_are_400(http, path, body, param):
    error = assert_error(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_malformed_json_is_400(http):
    resp = http.post("/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert_error(resp, 400)


def test_unknown_model_is_404_through_the_sdk(client):
    """A model the server does not serve: 404 with OpenAI's error JSON, as OpenAI and vLLM
    answer (the SDK raises NotFoundError), on every route that names a model."""
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found" and info.value.body["type"] == "not_found_error"
    assert info.value.body["param"] == "model" and "no-such-model" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1)
    assert chat.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):   # a stream is refused before it starts
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1, stream=True)


def test_api_key_required_on_v1(server, settings):
    with httpx.Client(base_url=server.base_url, timeout=60) as anon:
        body = {"prompt": "x", "max_tokens": 1}
        error = assert_error(anon.post("/v1/completions", json=body), 401)
        assert error["code"] == "invalid_api_key"
        assert_error(anon.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer not-the-key"}
        assert_error(anon.post("/v1/chat/completions", headers=wrong,
                               json={"messages": [{"role": "user", "content": "x"}]}), 401)
        # probes and scrapes need no key
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_server_keeps_serving_after_errors(client, http, settings):
    for _ in range(3):
        http.post("/v1/completions", json={"prompt": "x", "n": -1})
        http.post("/v1/completions", json={"prompt": [10**9]})
    resp = client.completions.create(model=settings.model, prompt="still alive?", max_tokens=2)
    assert resp.usage.completion_tokens == 2


def _long_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def test_disconnect_mid_stream_frees_blocks(server, http, metrics, settings):
    idle = metrics.wait_until_idle()
    aborts_before = idle["vllm:request_success_total{finished_reason=abort}"]
    body = {"model": settings.model, "prompt": _long_prompt(300, 1), "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {settings.api_key}"}) as c, \
            c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few tokens have streamed
        assert any(line.startswith("data: {") for line in received)
        busy = metrics.scrape()
        assert busy["vllm:kv_cache_usage_perc{}"] > 0
        assert busy["vllm:num_requests_running{}"] == 1
    # leaving the block closed the connection mid-stream
    after = metrics.wait_until_idle(timeout=30)
    assert after["vllm:request_success_total{finished_reason=abort}"] == aborts_before + 1
    assert after["vllm:generation_tokens_total{}"] < busy["vllm:generation_tokens_total{}"] + 1500


def test_disconnect_while_waiting_for_a_plain_response(server, metrics, settings):
    idle = metrics.wait_until_idle()
    body = {"model": settings.model, "prompt": _long_prompt(100, 2), "max_tokens": 1500,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=2.0,
                      headers={"Authorization": f"Bearer {settings.api_key}"}) as c, \
            pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    # The abort is counted once the engine has taken the request in; on a fresh server the
    # first step can outlast the client's 2 s, and until it ends nothing shows as running.
    aborts = "vllm:request_success_total{finished_reason=abort}"
    deadline = time.monotonic() + 30
    while metrics.scrape()[aborts] == idle[aborts]:
        assert time.monotonic() < deadline, "the abandoned request was never aborted"
        time.sleep(0.1)
    after = metrics.wait_until_idle(timeout=30)
    assert after[aborts] == idle[aborts] + 1


def test_full_waiting_queue_gives_429(server, http, metrics, settings):
    metrics.wait_until_idle()
    body = {"model": settings.model, "prompt": "keep going", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {settings.api_key}"}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=headers) as c:

            async def hold() -> None:  # a long stream, consumed until cancelled
                async with c.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass

            holders = [asyncio.ensure_future(hold())
                       for _ in range(settings.max_num_seqs + settings.max_waiting)]
            try:
                deadline = time.monotonic() + 60
                while True:
                    m = await asyncio.to_thread(metrics.scrape)
                    if (m["vllm:num_requests_running{}"] == settings.max_num_seqs
                            and m["vllm:num_requests_waiting{}"] == settings.max_waiting):
                        break
                    assert time.monotonic() < deadline, {k: v for k, v in m.items() if "vllm:num" in k}
                    await asyncio.sleep(0.1)
                return await c.post("/v1/completions", json={**body, "stream": False})
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    resp = asyncio.run(scenario())
    error = assert_error(resp, 429, "waiting")
    assert error["code"] == "rate_limit_exceeded"
    assert int(resp.headers["retry-after"]) >= 1
    metrics.wait_until_idle(timeout=60)
    ok = http.post("/v1/completions", json={"prompt": "after the storm", "max_tokens": 2})
    assert ok.status_code == 200
