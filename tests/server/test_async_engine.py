"""The app in-process around a real engine: 503 while loading, a failing engine step.

Faults are injected into the real ``LLMEngine`` (its ``step`` raises once); what is
under test is how the server's engine thread and routes cope.
"""

from __future__ import annotations

import asyncio
import copy
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import SamplingParams
from kvpilot.engine.server.app import build_app, build_in_process_client
from kvpilot.engine.server.config import ServerConfig
from kvpilot.engine.server.metrics import make_registry

pytestmark = pytest.mark.slow

BODY = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


def _error_count(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "error":
                return s.value
    raise AssertionError("no vllm:request_success_total{finished_reason=error}")


def test_step_outputs_are_never_modified_by_later_steps(offline_llm):
    # The async engine hands step() outputs to the event loop without copying them.
    engine = offline_llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
    engine.add_request("outputs-not-shared", "The capital of France is", params)
    delivered = []
    while engine.has_unfinished_requests():
        delivered += [(out, copy.deepcopy(out)) for out in engine.step()]
    assert len(delivered) >= 6
    assert all(out.outputs and out.outputs[0].logprobs for out, _ in delivered)
    for out, as_delivered in delivered:
        assert out == as_delivered


def test_loading_then_a_failing_step_then_a_dead_engine(offline_llm, monkeypatch):
    engine = offline_llm.llm_engine
    gate = threading.Event()

    def build():
        assert gate.wait(60), "test never opened the gate"
        return engine

    async_engine, state = build_in_process_client(build, ServerConfig(), make_registry())
    app = build_app(state)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            async_engine.start()
            # loading: health and generation answer 503 with error JSON
            health = await c.get("/health")
            assert health.status_code == 503
            assert health.json()["error"]["message"] == "the engine is loading"
            loading = await c.post("/v1/completions", json=BODY)
            assert loading.status_code == 503 and loading.json()["error"]["code"] == "engine_loading"
            gate.set()
            await async_engine.wait_ready()
            assert (await c.get("/health")).status_code == 200
            good = (await c.post("/v1/completions", json=BODY)).json()["choices"][0]["text"]

            # one failing step: the affected request gets 500, the next one is served
            real_step = engine.step
            failures = iter([RuntimeError("injected step failure")])

            def step_once_failing():
                for exc in failures:
                    raise exc
                return real_step()

            monkeypatch.setattr(engine, "step", step_once_failing)
            failed = await c.post("/v1/completions", json=BODY)
            assert failed.status_code == 500
            # a generic message with the request id; the exception's text only in the log
            assert "(request id" in failed.json()["error"]["message"]
            assert "injected" not in failed.text
            assert failed.json()["error"]["type"] == "server_error"
            again = await c.post("/v1/completions", json=BODY)
            assert again.status_code == 200 and again.json()["choices"][0]["text"] == good
            assert (await c.get("/health")).status_code == 200
            assert _error_count((await c.get("/metrics")).text) == 1

            # a broken engine (cannot even abort): 500 for the request, then 503 everywhere
            real_abort = engine.abort_request

            def always_failing_step():
                raise RuntimeError("injected: device lost")

            def abort_then_fail(ids):
                real_abort(ids)  # keep the shared engine clean for other tests
                raise RuntimeError("injected: abort failed")

            monkeypatch.setattr(engine, "step", always_failing_step)
            monkeypatch.setattr(engine, "abort_request", abort_then_fail)
            broken = await c.post("/v1/completions", json=BODY)
            assert broken.status_code == 500
            # the failed step is reported before the death it caused: /health turns 503 a moment later
            for _ in range(100):
                health = await c.get("/health")
                if health.status_code != 200:
                    break
                await asyncio.sleep(0.05)
            assert health.status_code == 503
            assert "abort failed" in health.json()["error"]["message"]
            after = await c.post("/v1/completions", json=BODY)
            assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        async_engine.shutdown()
        monkeypatch.undo()
    assert not engine.has_unfinished_requests()
