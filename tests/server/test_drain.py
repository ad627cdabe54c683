"""SIGTERM drains a real ``kvpilot serve`` (issue 16, acceptance 2).

50 streams are under way (each has had its first chunk) when the process gets SIGTERM.
Every one must still finish with ``[DONE]`` and the complete text the offline engine
(``LLM.generate``, same greedy parameters) produces; meanwhile /health and new requests
answer 503 (with ``Retry-After``) and /livez 200; then the process exits 0 within
``--shutdown-timeout``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.bench.server_process import launch_server

pytestmark = pytest.mark.slow

NUM_STREAMS = 50
MAX_TOKENS = 16
SHUTDOWN_TIMEOUT_S = 60
# float32 on both sides: the server batches the 50 streams as they arrive, the offline
# engine all at once, and in bfloat16 (``--dtype auto`` on a CPU with native bf16) two
# batch shapes round differently enough to flip a greedy near-tie now and then (seen
# in a CI run: the 31st of 50 texts diverged after 11 tokens).
ENGINE = {"model": "demo", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 64,
          "dtype": "float32"}
PROMPTS = [f"Story {i}: once upon a time" for i in range(NUM_STREAMS)]


@pytest.fixture
def server(tmp_path):
    flags = ["--model", "demo", "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
             "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
             "--max-num-seqs", str(ENGINE["max_num_seqs"]),
             "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--uvicorn-log-level", "warning"]
    with launch_server(flags, log_path=tmp_path / "serve.log", timeout=300) as launched:
        yield launched


async def _stream(http: httpx.AsyncClient, prompt: str, record: dict) -> None:
    """Streams one greedy completion; ``record`` gets the events and their arrival times."""
    body = {"model": "kvpilot-demo", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    record["events"], record["times"] = [], []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                record["events"].append(line[6:])
                record["times"].append(time.monotonic())
                record["first"].set()


def test_sigterm_finishes_50_streams_refuses_new_requests_and_exits_0(server):
    llm = LLM(**ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, params)]
    del llm

    async def scenario() -> dict:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            records = [{"first": asyncio.Event()} for _ in PROMPTS]
            tasks = [asyncio.ensure_future(_stream(http, p, r)) for p, r in zip(PROMPTS, records,
                                                                                 strict=True)]
            await asyncio.wait_for(asyncio.gather(*(r["first"].wait() for r in records)), 120)
            assert not any(t.done() for t in tasks)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as fresh:
                health = await fresh.get("/health")
                livez = await fresh.get("/livez")
                refused = await fresh.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                models = await fresh.get("/v1/models")
            await asyncio.wait_for(asyncio.gather(*tasks), SHUTDOWN_TIMEOUT_S)
            return {"records": records, "signalled": signalled, "health": health, "livez": livez,
                    "refused": refused, "models": models}

    result = asyncio.run(scenario())
    status = server.process.wait(SHUTDOWN_TIMEOUT_S + 15)
    exited = time.monotonic() - result["signalled"]

    records, signalled = result["records"], result["signalled"]
    assert result["health"].status_code == 503
    assert result["health"].json()["error"]["code"] == "shutting_down"
    assert result["livez"].status_code == 200
    for refused in (result["refused"], result["models"]):
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "shutting_down"
    texts = []
    for record in records:
        events = record["events"]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        texts.append("".join(c["choices"][0]["text"] for c in chunks))
    in_flight = sum(r["times"][0] < signalled < r["times"][-1] for r in records)
    last_chunk = max(r["times"][-1] for r in records) - signalled
    print(f"\n[A2] {NUM_STREAMS} streams in flight at SIGTERM (first chunk before it, [DONE] after "
          f"it: {in_flight}); {sum(t == e for t, e in zip(texts, expected, strict=True))}/"
          f"{NUM_STREAMS} texts equal LLM.generate's; last chunk {last_chunk:.2f} s after the "
          f"signal; after it /health {result['health'].status_code}, new request "
          f"{result['refused'].status_code} (Retry-After {result['refused'].headers['Retry-After']}), "
          f"/livez {result['livez'].status_code}; exit status {status} after {exited:.2f} s")
    assert in_flight == NUM_STREAMS
    assert texts == expected
    assert status == 0 and exited < SHUTDOWN_TIMEOUT_S
    assert "drained: every request in flight finished" in server.log_path.read_text()
