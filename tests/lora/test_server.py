"""LoRA through ``kvpilot serve`` (the engine core in its own process), with the openai SDK:
the ``model`` field selects an adapter, /v1/models lists adapters with their parent, the
runtime load / unload routes (behind the API key) under 200 concurrent streams, and
``vllm:lora_requests_info`` with vLLM's name, type and labels."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from kvpilot.engine.bench.server_process import launch_server

from support.lora_adapters import build_adapter, peft_greedy

pytestmark = pytest.mark.slow

KEY = "lora-key"
BASE = "base"
PROMPT = [11, 45, 99, 200, 301, 7, 88, 150, 42, 420]
MAX_NEW = 4


@pytest.fixture(scope="module")
def served(lora_case, tmp_path_factory):
    base, adapters = lora_case("qwen3")
    tmp = tmp_path_factory.mktemp("lora-serve")
    adapters = {**adapters, "extra": build_adapter(base, tmp / "extra", 8, seed=201),
                "late": build_adapter(base, tmp / "late", 16, seed=202)}
    static = ["sql", "chat", "attn", "extra"]
    flags = ["--model", str(base), "--dtype", "float32", "--served-model-name", BASE, "--enable-lora", "--max-loras", "4",
             "--max-lora-rank", "16", "--max-cpu-loras", "5",
             "--lora-modules", *(f"{n}={adapters[n]}" for n in static[:3]),
             f'{{"name": "extra", "path": "{adapters["extra"]}", "base_model_name": "{BASE}"}}',
             "--api-key", KEY, "--max-model-len", "256", "--num-gpu-blocks-override", "1024",
             "--max-num-seqs", "128", "--max-waiting-requests", "1000", "--uvicorn-log-level", "warning",
             "--log-stats-interval", "0"]
    server = launch_server(flags, log_path=tmp / "serve.log", timeout=300,
                           env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    tokenizer = AutoTokenizer.from_pretrained(base)
    expected = {name: tokenizer.decode(peft_greedy(base, adapters.get(name), [PROMPT], MAX_NEW)[0])
                for name in (None, *adapters)}
    expected.update({("long", name): tokenizer.decode(peft_greedy(base, adapters[name], [PROMPT], 24)[0])
                     for name in static})
    yield server, adapters, expected
    server.stop()


def _client(server, key=KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _models(server) -> list:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0).models.list().data


def test_models_lists_adapters_with_their_parent(served):
    server, adapters, _ = served
    models = _models(server)
    by_id = {m.id: m for m in models}
    assert set(by_id) == {BASE, "sql", "chat", "attn", "extra"}
    for name in ("sql", "chat", "attn", "extra"):
        assert by_id[name].parent == BASE and by_id[name].root == str(adapters[name])
    assert getattr(by_id[BASE], "parent", None) is None


def test_model_field_selects_the_adapter_in_one_batch(served):
    server, _, expected = served

    async def main():
        client = _client(server)
        names = [BASE, "sql", "chat", "attn", "extra"] * 3
        outs = await asyncio.gather(*(client.completions.create(
            model=n, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0) for n in names))
        return names, outs

    names, outs = asyncio.run(main())
    for name, out in zip(names, outs, strict=True):
        assert out.model == name
        assert out.choices[0].text == expected[None if name == BASE else name], name


def _lora_info(server) -> list:
    text = httpx.get(f"{server.base_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families, families.get("vllm:lora_requests_info")


def test_lora_requests_info_is_vllms(served):
    server, _, _ = served

    async def main():
        client = _client(server)
        await asyncio.gather(*(client.completions.create(model=n, prompt=PROMPT, max_tokens=MAX_NEW)
                               for n in ("sql", "chat")))

    before = time.time()
    asyncio.run(main())
    families, info = _lora_info(server)
    assert info is not None and info.type == "gauge"
    assert info.documentation == "Running stats on lora requests."
    for sample in info.samples:
        assert set(sample.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
        assert sample.labels["max_lora"] == "4"
    latest = max(info.samples, key=lambda s: s.value)
    assert latest.value >= before - 1          # a Unix timestamp of the last update
    seen = {name for s in info.samples for name in s.labels["running_lora_adapters"].split(",") if name}
    assert {"sql", "chat"} <= seen
    requests = {s.labels["lora_name"]: s.value for s in families["kvpilot:lora_requests"].samples
                if s.name.endswith("_total")}
    assert requests["sql"] >= 1 and requests["chat"] >= 1


def test_runtime_routes_need_the_key_and_refuse_bad_input(served, tmp_path):
    server, adapters, _ = served
    url = server.base_url
    body = {"lora_name": "x", "lora_path": str(adapters["late"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{url}/v1/load_lora_adapter", headers=auth,
                         json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    taken = httpx.post(f"{url}/v1/load_lora_adapter", headers=auth,
                       json={"lora_name": "sql", "lora_path": str(adapters["late"])})
    assert taken.status_code == 400 and "already been loaded" in taken.json()["error"]["message"]
    unknown = httpx.post(f"{url}/v1/unload_lora_adapter", headers=auth, json={"lora_name": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{url}/health").status_code == 200


def test_load_and_unload_under_200_streams(served):
    """200 streams across 4 adapters. The first 100 are running (their responses have
    begun) when ``extra`` is unloaded; the next 100 start as soon as the unload returns,
    while ``late`` is being loaded. Every stream succeeds with its adapter's output (those
    of ``extra`` in flight at the unload included), except the second wave's requests for
    ``extra``, which get 404 with the OpenAI error body."""
    server, adapters, expected = served
    names = ["sql", "chat", "attn", "extra"]
    long_new = 24

    async def open_stream(client, name, max_tokens):
        try:
            return await client.completions.create(model=name, prompt=PROMPT, max_tokens=max_tokens,
                                                   temperature=0.0, stream=True)
        except openai.APIStatusError as exc:
            return exc

    async def read(stream):
        if isinstance(stream, Exception):
            return None, stream
        return "".join([c.choices[0].text async for c in stream if c.choices]), None

    async def main():
        client = _client(server)
        first = await asyncio.gather(*(open_stream(client, names[i % 4], long_new) for i in range(100)))
        reading = [asyncio.ensure_future(read(s)) for s in first]
        unloaded = await client.post("/unload_lora_adapter", cast_to=httpx.Response,
                                     body={"lora_name": "extra"})
        load = asyncio.ensure_future(client.post("/load_lora_adapter", cast_to=httpx.Response,
                                                 body={"lora_name": "late", "lora_path": str(adapters["late"])}))
        second = await asyncio.gather(*(open_stream(client, names[i % 4], MAX_NEW) for i in range(100)))
        second_results = await asyncio.gather(*(read(s) for s in second))
        loaded = await load
        late = await asyncio.gather(*[open_stream(client, "late", MAX_NEW) for _ in range(8)])
        late = await asyncio.gather(*[read(s) for s in late])
        return unloaded, loaded, await asyncio.gather(*reading), second_results, late

    started = time.monotonic()
    unloaded, loaded, first, second, late = asyncio.run(main())
    elapsed = time.monotonic() - started
    assert unloaded.status_code == 200 and loaded.status_code == 200
    for i, (text, error) in enumerate(first):      # in flight at the unload: all finish
        assert error is None, (names[i % 4], error)
        assert text == expected[("long", names[i % 4])], names[i % 4]
    not_found = 0
    for i, (text, error) in enumerate(second):
        name = names[i % 4]
        if name != "extra":
            assert error is None and text == expected[name], (name, error)
            continue
        assert error is not None and error.status_code == 404, (name, text)
        assert error.body["code"] == "model_not_found" and error.body["type"] == "not_found_error"
        not_found += 1
    assert not_found == 25
    assert all(e is None and t == expected["late"] for t, e in late)
    print(f"\n200 streams over 4 adapters, unload + load mid-way: {elapsed:.1f} s wall; "
          f"{not_found} requests for the unloaded adapter got 404, none other failed")
    models = {m.id for m in _models(server)}
    assert "late" in models and "extra" not in models
