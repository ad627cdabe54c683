"""The runtime LoRA routes on the in-process engine (``--engine-in-process``: the engine on
a thread of the server's process), and their gate: without
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` / ``--allow-runtime-lora-updating`` they answer 404."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.lora.config import LoRAModule
from kvpilot.engine.server.app import build_app, build_in_process_client
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.metrics import make_registry

from support.lora_adapters import peft_greedy

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 230, 99, 41, 310, 12]


def _run(engine_args: EngineArgs, scenario) -> None:
    async_engine, state = build_in_process_client(lambda: LLMEngine(engine_args), ServerConfig(api_key="k"),
                                             make_registry())
    app = build_app(state)

    async def main() -> None:
        async_engine.start()
        await async_engine.wait_ready()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"Authorization": "Bearer k"}) as client:
            await scenario(client)

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()


def _args(base, adapters, **kwargs) -> EngineArgs:
    return EngineArgs(model=str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                      lora_modules=(LoRAModule("sql", str(adapters["sql"])),),
                      num_gpu_blocks=128, max_model_len=128, **kwargs)


def test_load_unload_on_the_engine_thread(lora_case):
    base, adapters = lora_case("llama")
    expected = {n: peft_greedy(base, adapters[n], [PROMPT], 4)[0] for n in ("sql", "chat")}

    async def complete(client, model):
        return await client.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                          "max_tokens": 4, "temperature": 0})

    async def scenario(client: httpx.AsyncClient) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        assert (await complete(client, "chat")).status_code == 404     # never loaded: not served
        loaded = await client.post("/v1/load_lora_adapter",
                                   json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        for name in ("sql", "chat"):
            out = (await complete(client, name)).json()
            assert out["model"] == name and out["choices"][0]["text"] == tokenizer.decode(expected[name])
        models = (await client.get("/v1/models")).json()["data"]
        assert {m["id"]: m.get("parent") for m in models}["chat"] == base.name
        removed = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert removed.status_code == 200
        gone = await complete(client, "chat")
        assert gone.status_code == 404
        assert gone.json()["error"] == {"message": "The model `chat` does not exist.",
                                        "type": "not_found_error", "param": "model",
                                        "code": "model_not_found"}

    _run(_args(base, adapters, allow_runtime_lora_updating=True), scenario)


def test_runtime_routes_are_off_unless_allowed(lora_case):
    base, adapters = lora_case("llama")

    async def scenario(client: httpx.AsyncClient) -> None:
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            response = await client.post(f"/v1/{route}", json={"lora_name": "sql", "lora_path": "/x"}
                                         if route.startswith("load") else {"lora_name": "sql"})
            assert response.status_code == 404
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in response.json()["error"]["message"]
        # the adapters loaded at start-up still serve
        out = await client.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 2})
        assert out.status_code == 200

    _run(_args(base, adapters), scenario)
